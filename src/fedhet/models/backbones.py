"""Transformer backbones from Hugging Face ``transformers`` (the ``transformers`` extra), as fedhet ``FedModel``s.

Three families, each a preset small enough to train on a laptop CPU and the standard sizes by name, every one built
offline from its config (no download; ``model.pretrained`` adds weights, see ``pretrained_tensors``):

* images: a ViT (``vit_tiny``, ``vit_base``): the body is ``ViTModel`` without its pooler, the embedding the final
  [CLS] token, the head ``ViTForImageClassification``'s classifier;
* text classification: BERT (``bert_tiny``, ``bert_base``) and DistilBERT (``distilbert``) over token ids, the
  embedding BERT's pooler on the first token (``pooling = "cls"``, the pretrained recipe) or the mean of the
  unpadded tokens (``"mean"``, for fedhet's left-padded character ids);
* next token: GPT-2 (``gpt_tiny``, ``gpt2``): the embedding is the last position's hidden state, the head (no bias)
  predicts the next token, as ``GPT2LMHeadModel``'s ``lm_head`` does.

Attention is the "eager" implementation: PyTorch's fused SDPA kernels may pick different algorithms by shape and
machine, so the plain matmul-softmax keeps a kill-and-resume bit for bit. The tiny presets have no dropout, which
also lets the batched executor train them under vmap. Checking a model against a dataset's input
(``check_input``, used by ``models/fit.py``) needs no ``transformers`` import, which takes seconds.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from pydantic import Field, PositiveInt
from torch import Tensor, nn

from fedhet.errors import ConfigError
from fedhet.models.base import MODELS, FedModel, ModelParams, check_rank
from fedhet.models.hub import resolve_pretrained

INSTALL = "pip install 'fedhet[pretrained]' (Hugging Face transformers)"
ATTENTION = "eager"  # deterministic on the CPU; see the module docstring


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"the transformer models need Hugging Face transformers: {INSTALL}") from None
    transformers.logging.set_verbosity_error()
    return transformers


class BackboneParams(ModelParams):
    # weights (and the architecture: its config.json replaces the size parameters below): a local folder written
    # by save_pretrained, a .safetensors file beside its config.json, or a hub id found in the Hugging Face cache
    pretrained: str | None = Field(None, min_length=1)
    layers: PositiveInt = 2  # transformer blocks
    heads: PositiveInt = 4  # attention heads (hidden must be a multiple)
    hidden: PositiveInt = 64  # the embedding width, and the head's input
    mlp: PositiveInt = 128  # the feed-forward width
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # hidden and attention dropout


class VitParams(BackboneParams):
    patch_size: PositiveInt = 7  # 28x28 -> 16 patches, 32x32 -> 16 (the rest of the image is cut off)


class VitBaseParams(VitParams):  # ViT-B/16 (Dosovitskiy et al. 2021)
    layers: PositiveInt = 12
    heads: PositiveInt = 12
    hidden: PositiveInt = 768
    mlp: PositiveInt = 3072
    patch_size: PositiveInt = 16
    dropout: float = Field(0.0, ge=0.0, lt=1.0)


class TextParams(BackboneParams):
    vocab_size: PositiveInt = 80  # token ids the embedding takes (Shakespeare's 80 characters; an hf text vocab_size)
    max_len: PositiveInt = 512  # position embeddings: the longest sequence
    # the padding id, left out of attention and of the mean (fedhet's hf text pads with 0); None: every token counts
    pad_id: int | None = Field(0, ge=0)
    # the embedding: "cls", BERT's pooler on the first token (DistilBERT's pre-classifier), as the pretrained
    # classifiers read it (a tokenizer that puts [CLS] first); "mean", the mean of the unpadded tokens
    pooling: Literal["cls", "mean"] = "mean"


class BertBaseParams(TextParams):  # BERT-base (Devlin et al. 2019)
    vocab_size: PositiveInt = 30522
    layers: PositiveInt = 12
    heads: PositiveInt = 12
    hidden: PositiveInt = 768
    mlp: PositiveInt = 3072
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    pooling: Literal["cls", "mean"] = "cls"


class DistilBertParams(BertBaseParams):  # DistilBERT (Sanh et al. 2019): BERT-base with 6 layers
    layers: PositiveInt = 6


class GptParams(BackboneParams):
    vocab_size: PositiveInt = 80
    max_len: PositiveInt = 128
    pad_id: int | None = Field(None, ge=0)  # Shakespeare has no padding (its id 0 is the newline)


class Gpt2Params(GptParams):  # GPT-2 small (Radford et al. 2019)
    vocab_size: PositiveInt = 50257
    max_len: PositiveInt = 1024
    layers: PositiveInt = 12
    heads: PositiveInt = 12
    hidden: PositiveInt = 768
    mlp: PositiveInt = 3072
    dropout: float = Field(0.1, ge=0.0, lt=1.0)


# ---------------------------------------------------------------------------------------------- the bodies
class VitBody(nn.Module):
    """(B, C, H, W) -> the final [CLS] token, (B, hidden); other image sizes than the config's interpolate the
    position embeddings (a pretrained 224x224 model on 32x32 images)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.vit = transformers_module().ViTModel(config, add_pooling_layer=False)
        self.image_size = config.image_size

    def forward(self, x: Tensor) -> Tensor:
        resize = tuple(x.shape[-2:]) != (self.image_size, self.image_size)
        return self.vit(pixel_values=x, interpolate_pos_encoding=resize).last_hidden_state[:, 0]


# engine/batched.py reads it: transformers builds BERT's and DistilBERT's padding mask with data-dependent control flow
MASK_UNBATCHABLE = "masks padding in attention (model.pad_id), which vmap cannot trace through transformers"


def attention_mask(x: Tensor, pad_id: int | None) -> Tensor | None:
    return None if pad_id is None else (x != pad_id).long()


class BertBody(nn.Module):
    """(B, L) token ids -> BERT's pooler on the first token ("cls"), or the mean of the unpadded tokens."""

    def __init__(self, config, pooling: str, pad_id: int | None) -> None:
        super().__init__()
        self.bert = transformers_module().BertModel(config, add_pooling_layer=pooling == "cls")
        self.pooling, self.pad_id = pooling, pad_id
        self.unbatchable_reason = MASK_UNBATCHABLE if pad_id is not None else None

    def forward(self, x: Tensor) -> Tensor:
        mask = attention_mask(x, self.pad_id)
        out = self.bert(input_ids=x, attention_mask=mask)
        return out.pooler_output if self.pooling == "cls" else masked_mean(out.last_hidden_state, mask)


class DistilBertBody(nn.Module):
    """(B, L) token ids -> DistilBERT's classifier input: ReLU(pre_classifier(first token)) ("cls"), or the mean."""

    def __init__(self, config, pooling: str, pad_id: int | None) -> None:
        super().__init__()
        self.distilbert = transformers_module().DistilBertModel(config)
        self.pre_classifier = nn.Linear(config.dim, config.dim) if pooling == "cls" else None
        self.pooling, self.pad_id = pooling, pad_id
        self.unbatchable_reason = MASK_UNBATCHABLE if pad_id is not None else None

    def forward(self, x: Tensor) -> Tensor:
        mask = attention_mask(x, self.pad_id)
        hidden = self.distilbert(input_ids=x, attention_mask=mask).last_hidden_state
        if self.pre_classifier is None:
            return masked_mean(hidden, mask)
        return torch.relu(self.pre_classifier(hidden[:, 0]))


class GptBody(nn.Module):
    """(B, L) token ids -> the last position's hidden state (after the final layer norm): what predicts the next
    token. With a padding id, positions count from the first real token, so left padding changes nothing."""

    def __init__(self, config, pad_id: int | None) -> None:
        super().__init__()
        self.transformer = transformers_module().GPT2Model(config)
        self.pad_id = pad_id

    def forward(self, x: Tensor) -> Tensor:
        mask = attention_mask(x, self.pad_id)
        positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.transformer(input_ids=x, attention_mask=mask, position_ids=positions, use_cache=False)
        return out.last_hidden_state[:, -1]


def masked_mean(hidden: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return hidden.mean(1)
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


# ---------------------------------------------------------------------------------------------- configs
def hf_config(name: str, p: BackboneParams, sizes: dict[str, Any]):
    """The model's ``transformers`` config: the pretrained one's (read from its folder) or one from ``sizes``."""
    t = transformers_module()
    if p.pretrained is not None:
        folder = resolve_pretrained(name, p.pretrained)
        config = t.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        want = FAMILY[name]
        if config.model_type != want:
            raise ConfigError(
                f"model {name!r}: model.pretrained {p.pretrained!r} is a {config.model_type!r} model, not "
                f"{want!r}; choose one of the {want} models ({', '.join(n for n, f in FAMILY.items() if f == want)})"
            )
    else:
        config = getattr(t, CONFIGS[FAMILY[name]])(**sizes)
    config._attn_implementation = ATTENTION
    return config


def vit_sizes(input_shape: tuple[int, ...], p: VitParams) -> dict[str, Any]:
    return dict(
        image_size=input_shape[1],
        num_channels=input_shape[0],
        patch_size=p.patch_size,
        hidden_size=p.hidden,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        intermediate_size=p.mlp,
        hidden_dropout_prob=p.dropout,
        attention_probs_dropout_prob=p.dropout,
    )


def bert_sizes(p: TextParams) -> dict[str, Any]:
    return dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        intermediate_size=p.mlp,
        max_position_embeddings=p.max_len,
        hidden_dropout_prob=p.dropout,
        attention_probs_dropout_prob=p.dropout,
        pad_token_id=p.pad_id if p.pad_id is not None else 0,
    )


def distilbert_sizes(p: TextParams) -> dict[str, Any]:
    return dict(
        vocab_size=p.vocab_size,
        dim=p.hidden,
        n_layers=p.layers,
        n_heads=p.heads,
        hidden_dim=p.mlp,
        max_position_embeddings=p.max_len,
        dropout=p.dropout,
        attention_dropout=p.dropout,
        pad_token_id=p.pad_id if p.pad_id is not None else 0,
    )


def gpt_sizes(p: GptParams) -> dict[str, Any]:
    return dict(
        vocab_size=p.vocab_size,
        n_positions=p.max_len,
        n_embd=p.hidden,
        n_layer=p.layers,
        n_head=p.heads,
        n_inner=p.mlp,
        resid_pdrop=p.dropout,
        embd_pdrop=p.dropout,
        attn_pdrop=p.dropout,
    )


# model name -> its transformers model_type
FAMILY = {
    "vit_tiny": "vit",
    "vit_base": "vit",
    "bert_tiny": "bert",
    "bert_base": "bert",
    "distilbert": "distilbert",
    "gpt_tiny": "gpt2",
    "gpt2": "gpt2",
}
TEXT = frozenset(name for name, family in FAMILY.items() if family != "vit")
CONFIGS = {"vit": "ViTConfig", "bert": "BertConfig", "distilbert": "DistilBertConfig", "gpt2": "GPT2Config"}


# ---------------------------------------------------------------------------------------------- fitting
def check_input(name: str, input_shape: tuple[int, ...], p: BackboneParams) -> None:
    """What building would refuse about ``input_shape`` and the sizes, without importing transformers (fit.py)."""
    if p.pretrained is None and p.hidden % p.heads:
        raise ConfigError(f"model {name!r}: model.hidden ({p.hidden}) must be a multiple of model.heads ({p.heads})")
    if name in TEXT:
        check_rank(name, input_shape, 1, "(80,)")
        if p.pretrained is None and input_shape[0] > p.max_len:
            raise ConfigError(
                f"model {name!r} takes sequences of at most {p.max_len} tokens (model.max_len), got {input_shape[0]}"
            )
        return
    check_rank(name, input_shape, 3, "(3, 32, 32)")
    _, height, width = input_shape
    if height != width:
        raise ConfigError(f"model {name!r} takes square images, got {height}x{width}")
    if p.pretrained is None and p.patch_size > height:
        raise ConfigError(
            f"model {name!r} cannot take inputs of shape {tuple(input_shape)}: too small for patches of "
            f"{p.patch_size} (model.patch_size)"
        )


def check_config(name: str, input_shape: tuple[int, ...], config) -> None:
    """A pretrained config that cannot take this input: other channels, or a sequence longer than its positions."""
    if name in TEXT:
        longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if longest is not None and input_shape[0] > longest:
            raise ConfigError(f"model {name!r} (pretrained) takes at most {longest} tokens, got {input_shape[0]}")
    elif config.num_channels != input_shape[0]:
        raise ConfigError(
            f"model {name!r} (pretrained) takes {config.num_channels}-channel images, the dataset has "
            f"{input_shape[0]} channels"
        )


def build(name: str, input_shape: tuple[int, ...], num_classes: int, p: BackboneParams) -> FedModel:
    check_input(name, input_shape, p)
    family = FAMILY[name]
    sizes = {
        "vit": lambda: vit_sizes(input_shape, p),
        "bert": lambda: bert_sizes(p),
        "distilbert": lambda: distilbert_sizes(p),
        "gpt2": lambda: gpt_sizes(p),
    }[family]()
    config = hf_config(name, p, sizes)
    check_config(name, input_shape, config)
    pad_id = getattr(p, "pad_id", None)
    if family == "vit":
        body: nn.Module = VitBody(config)
    elif family == "bert":
        body = BertBody(config, p.pooling, pad_id)
    elif family == "distilbert":
        body = DistilBertBody(config, p.pooling, pad_id)
    else:
        body = GptBody(config, pad_id)
    width = config.dim if family == "distilbert" else config.n_embd if family == "gpt2" else config.hidden_size
    # GPT-2's lm_head has no bias; the classifiers of the others have one
    return FedModel({family: body}, width, num_classes, head_bias=family != "gpt2")


def register(name: str, summary: str, params: type[BackboneParams]) -> None:
    def builder(input_shape: tuple[int, ...], num_classes: int, p: BackboneParams) -> FedModel:
        return build(name, input_shape, num_classes, p)

    builder.check_input = functools.partial(check_input, name)  # type: ignore[attr-defined]
    MODELS.register(name, summary, params=params)(builder)


PRESETS = {
    "vit_tiny": ("ViT, tiny preset: patch 7, 2 layers, hidden 64, 4 heads (CPU-sized)", VitParams),
    "vit_base": ("ViT-B/16: 12 layers, hidden 768 (GPU-sized; weights: model.pretrained)", VitBaseParams),
    "bert_tiny": ("BERT text classifier, tiny preset: 2 layers, hidden 64, mean pooling", TextParams),
    "bert_base": ("BERT-base text classifier: 12 layers, hidden 768, [CLS] pooler", BertBaseParams),
    "distilbert": ("DistilBERT text classifier: 6 layers, hidden 768, [CLS]", DistilBertParams),
    "gpt_tiny": ("GPT-2-style next-token model, tiny preset: 2 layers, hidden 64, last position", GptParams),
    "gpt2": ("GPT-2 small next-token model: 12 layers, hidden 768 (weights: model.pretrained)", Gpt2Params),
}
for _name, (_summary, _params) in PRESETS.items():
    register(_name, f"{_summary}; Hugging Face transformers", _params)


# ---------------------------------------------------------------------------------------------- pretrained weights
# the transformers class whose checkpoint names fedhet's body and head follow, and where the head lives in it
HEADS = {
    "vit": ("ViTForImageClassification", "vit", "classifier"),
    "bert": ("BertForSequenceClassification", "bert", "classifier"),
    "distilbert": ("DistilBertForSequenceClassification", "distilbert", "classifier"),
    "gpt2": ("GPT2LMHeadModel", "transformer", "lm_head"),
}


def pretrained_tensors(name: str, pretrained: str) -> tuple[dict[str, Tensor], bool]:
    """The weights the checkpoint holds, under fedhet's names (``body.<family>.<its name>``, ``head.weight``), and
    whether it has a trained head. ``transformers`` reads the checkpoint, so its own renamings of old checkpoints
    apply; what the checkpoint lacks (a pooler, DistilBERT's pre-classifier) is left out, to keep its fresh weights."""
    family = FAMILY[name]
    loaded = _load(HEADS[family][0], str(resolve_pretrained(name, pretrained)))
    head = HEADS[family][2]
    tensors = {}
    for key, value in loaded["state"].items():
        if key.startswith(head + "."):
            if loaded["head"]:
                tensors["head." + key.split(".", 1)[1]] = value
        elif key not in loaded["missing"]:
            tensors[f"body.{family}.{key}"] = value
    return tensors, loaded["head"]


@functools.lru_cache(maxsize=2)
def _load(cls_name: str, folder: str) -> dict[str, Any]:
    """The checkpoint's state dict, read once per process, the names it lacked, and whether its head was in it."""
    cls = getattr(transformers_module(), cls_name)
    with torch.random.fork_rng(devices=[]):  # transformers draws the weights it does not find: keep the run's stream
        model, info = cls.from_pretrained(
            folder, local_files_only=True, output_loading_info=True, attn_implementation=ATTENTION
        )
    head = HEADS[model.config.model_type][2]
    missing = set(info.get("missing_keys", ()))
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "missing": missing,
        "head": not any(k.startswith(head + ".") for k in missing),
    }
