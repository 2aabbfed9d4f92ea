"""Which of a built model's parameters train: frozen layers (``model.freeze``) and LoRA adapters (``model.lora_*``).

Both act on a model after it is built (and after an algorithm's ``prepare_model``), by module name, so they apply to
any model, a plug-in's or a Hugging Face backbone's alike. A frozen parameter is one with ``requires_grad = False``:
``toolkit/flat.py``'s flat vector leaves it out, so it gets no gradient, weight decay or momentum, never travels and
is never aggregated; every process rebuilds it identically from the run's seed (``engine/training.py``).

LoRA (Hu et al. 2022) is ``peft``'s: each adapted layer ``W x`` becomes ``W x + (alpha / r) B A x`` with ``W`` frozen,
``A`` (r x in, Kaiming-uniform) and ``B`` (out x r, zeros) trained. ``peft`` is imported only when LoRA is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedhet.errors import ConfigError

ADAPTABLE = (nn.Linear, nn.Conv2d)  # the layer types peft's LoRA wraps that fedhet's models use
ADAPTER = "default"  # peft's adapter name: parameters are named <layer>.lora_A.default.weight


@dataclass(frozen=True)
class LoraSpec:
    """LoRA's settings for one run: ``rank`` r, ``alpha`` (the update is scaled by alpha / r), ``dropout`` on the
    adapter's input, ``targets`` (module names; None: every Linear layer of the body), ``train_a`` (False: FFA-LoRA,
    the A matrices stay at their initialisation)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    train_a: bool = True


def adapt(model: nn.Module, name: str, freeze: str | list[str] = "none", lora: LoraSpec | None = None) -> nn.Module:
    """Freeze the modules ``freeze`` names ("none", "body", or module names) and add LoRA adapters; ``name`` is the
    model's name for messages. The adapters always train (their A matrices not under FFA); a layer they adapt keeps
    its own weights frozen. Refuses, in one line, a name that is no module, a rank too large, or nothing to train."""
    for module_name in frozen_modules(model, name, freeze):
        for p in model.get_submodule(module_name).parameters():
            p.requires_grad_(False)
    if lora is not None:
        model = add_lora(model, name, lora)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model.freeze={freeze!r} leaves model {name!r} no parameter to train; freeze fewer modules")
    return model


def frozen_modules(model: nn.Module, name: str, freeze: str | list[str]) -> list[str]:
    """The module names ``freeze`` stands for, each checked against the model's."""
    if freeze == "none":
        return []
    names = ["body"] if freeze == "body" else list(freeze)
    modules = dict(model.named_modules())
    for module_name in names:
        if module_name not in modules or not module_name:
            top = [n for n in modules if n and "." not in n]
            nested = next((n for n in modules if "." in n), None)
            example = f" (a submodule is named by its dotted path, e.g. {nested!r})" if nested else ""
            raise ConfigError(
                f"model.freeze: model {name!r} has no module {module_name!r}; its modules: {', '.join(top)}{example}"
            )
    return names


def adaptable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> every Linear and Conv2d layer of the model, in module order."""
    return {n: m for n, m in model.named_modules() if type(m) in ADAPTABLE}


def lora_targets(model: nn.Module, name: str, targets: tuple[str, ...] | None) -> list[str]:
    """The layers LoRA adapts: ``targets``, or every Linear layer of the body; each checked to be adaptable."""
    layers = adaptable_layers(model)
    listed = ", ".join(layers) or "none"
    if targets is None:
        chosen = [n for n, m in layers.items() if n.startswith("body.") and isinstance(m, nn.Linear)]
        if not chosen:
            raise ConfigError(
                f"model.lora_rank: LoRA adapts the Linear layers of the body by default, and model {name!r} has none; "
                f"name the layers to adapt in model.lora_targets (its Linear and Conv2d layers: {listed})"
            )
        return chosen
    modules = dict(model.named_modules())
    for target in targets:
        if target not in modules:
            raise ConfigError(
                f"model.lora_targets: model {name!r} has no module {target!r}; its Linear and Conv2d layers: {listed}"
            )
        if target not in layers:
            kind = type(modules[target]).__name__
            raise ConfigError(
                f"model.lora_targets: {target!r} is a {kind}; LoRA adapts Linear and Conv2d layers: {listed}"
            )
    return list(dict.fromkeys(targets))


def layer_dims(layer: nn.Module) -> tuple[int, int]:
    """(in, out) of the layer's weight as a matrix: a Conv2d's A sees in_channels x kernel positions."""
    if isinstance(layer, nn.Conv2d):
        kh, kw = layer.kernel_size
        return layer.in_channels // layer.groups * kh * kw, layer.out_channels
    return layer.in_features, layer.out_features


def add_lora(model: nn.Module, name: str, spec: LoraSpec) -> nn.Module:
    """``model`` with peft's LoRA adapters on the target layers; other parameters keep their ``requires_grad``."""
    chosen = lora_targets(model, name, spec.targets)
    layers = adaptable_layers(model)
    for target in chosen:
        fan_in, fan_out = layer_dims(layers[target])
        if spec.rank > min(fan_in, fan_out):
            raise ConfigError(
                f"model.lora_rank={spec.rank} exceeds the rank of layer {target!r} ({type(layers[target]).__name__}, "
                f"{fan_in} in, {fan_out} out): at most min(in, out) = {min(fan_in, fan_out)}"
            )
        if isinstance(layers[target], nn.Conv2d) and layers[target].groups != 1:
            raise ConfigError(f"model.lora_targets: {target!r} is a grouped convolution, which LoRA does not adapt")
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ConfigError(
            "model.lora_rank needs the peft package: pip install 'fedhet[pretrained]' (or set model.lora_rank=0)"
        ) from None

    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    pattern = "^(" + "|".join(t.replace(".", r"\.") for t in chosen) + ")$"
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=pattern)
    model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for param_name, p in model.named_parameters():
        if ".lora_" in param_name:
            p.requires_grad_(spec.train_a or ".lora_A." not in param_name)
        elif ".base_layer." in param_name:
            p.requires_grad_(False)  # the adapted layer's own weight and bias
        else:
            p.requires_grad_(trainable[param_name])  # peft froze everything else; freeze decides there
    return model


def lora_layers(model: nn.Module) -> list[str]:
    """The names of the layers that carry a LoRA adapter, in module order."""
    return [n for n, m in model.named_modules() if hasattr(m, "lora_A") and ADAPTER in getattr(m, "lora_A", {})]


class RankMask:
    """Heterogeneous LoRA ranks on one model (``model.lora_ranks``): a forward hook on every adapter's A zeroes its
    outputs from ``rank`` on, so the layer computes ``s B[:, :rank] A[:rank] x``, the truncated adapter, and the
    slots past ``rank`` get no gradient. ``rank`` None: the whole adapter (the server's model, evaluation)."""

    def __init__(self, model: nn.Module) -> None:
        self.rank: int | None = None
        for layer in lora_layers(model):
            model.get_submodule(layer).lora_A[ADAPTER].register_forward_hook(self.hook)

    def hook(self, module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if self.rank is None:
            return None
        conv = isinstance(module, nn.Conv2d)
        slots = torch.arange(module.out_channels if conv else module.out_features, device=out.device)
        keep = (slots < self.rank).to(out.dtype)
        # the slot axis: a Conv2d's channels (before height and width), a Linear's last; also per sample under vmap
        return out * (keep.view(-1, 1, 1) if conv else keep)
