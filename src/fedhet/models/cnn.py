"""Small convolutional networks used by the papers fedhet reproduces.

Each body has stages `conv1`, `conv2`, `fc1`, ... whose names are the taps of `forward_features`. The flatten
size comes from a dry run on the input shape, so the same model works for 28x28 and 32x32 inputs.
"""

from __future__ import annotations

from pydantic import Field, NonNegativeInt, PositiveInt
from torch import nn

from fedhet.models.base import MODELS, FedModel, ModelParams, check_rank, flat_size


def conv_stage(c_in: int, c_out: int, kernel: int = 5, padding: int = 0) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, padding=padding), nn.ReLU(), nn.MaxPool2d(2))


def fc_stage(d_in: int, d_out: int, flatten: bool = False) -> nn.Sequential:
    layers = [nn.Flatten()] if flatten else []
    return nn.Sequential(*layers, nn.Linear(d_in, d_out), nn.ReLU())


def conv_fc_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    convs: list[nn.Module],
    hidden: list[int],
    head_bias: bool = True,
) -> FedModel:
    """Conv stages, then fully connected ReLU stages of the given widths (the last one is the embedding)."""
    stages: dict[str, nn.Module] = {f"conv{i + 1}": conv for i, conv in enumerate(convs)}
    width = flat_size(name, nn.Sequential(*convs), input_shape)
    for i, out in enumerate(hidden):
        stages[f"fc{i + 1}"] = fc_stage(width, out, flatten=i == 0)
        width = out
    if not hidden:  # the flattened conv output is the embedding
        stages["flatten"] = nn.Flatten()
    return FedModel(stages, width, num_classes, head_bias=head_bias)


class CNNParams(ModelParams):
    # FedNH drops the classifier bias "for fair comparison"; FedRoD and FedDyn keep it.
    head_bias: bool = True
    # widths of the fully connected layers; the last is the embedding. FedRoD/FedNH/FedDyn: 384-192. FedUFO's
    # discriminator reads a 64-d feature of "the same network as [McMahan et al.]", so its CIFAR-10 reading is
    # 384-64 (notes/fedufo.md section 4).
    hidden: list[PositiveInt] = Field(default_factory=lambda: [384, 192], min_length=1)


@MODELS.register(
    "cnn",
    "simple CNN of FedRoD/FedNH/FedDyn (2x conv5x5-64, fc 384-192; FedUFO: hidden=[384, 64])",
    params=CNNParams,
)
def build_cnn(input_shape: tuple[int, ...], num_classes: int, p: CNNParams) -> FedModel:
    check_rank("cnn", input_shape, 3, "(3, 32, 32)")
    convs = [conv_stage(input_shape[0], 64), conv_stage(64, 64)]
    return conv_fc_model("cnn", input_shape, num_classes, convs, list(p.hidden), head_bias=p.head_bias)


class LeNet5Params(ModelParams):
    pass


@MODELS.register("lenet5", "LeNet-5 (conv 6-16, fc 120-84); FedBC's cifarCNN, chenfan95/FedBC", params=LeNet5Params)
def build_lenet5(input_shape: tuple[int, ...], num_classes: int, p: LeNet5Params) -> FedModel:
    check_rank("lenet5", input_shape, 3, "(3, 32, 32)")
    # LeNet-5 was designed for 32x32; smaller images (MNIST's 28x28) get the classic 2-pixel pad on conv1.
    padding = 2 if min(input_shape[1:]) < 32 else 0
    convs = [conv_stage(input_shape[0], 6, padding=padding), conv_stage(6, 16)]
    return conv_fc_model("lenet5", input_shape, num_classes, convs, [120, 84])


class ConvNetParams(ModelParams):
    channels: tuple[PositiveInt, PositiveInt] = (32, 64)  # McMahan et al. 2017, "CNN" for MNIST
    # McMahan et al. 2017 use 512; 0 = no hidden layer, the classifier reads the flattened conv output (FedRANE's
    # official CNNModel: channels (16, 32), FC 1568 -> C; XeniaLLL/HyperFed_and_FedRANE-master system/main.py)
    hidden: NonNegativeInt = 512


@MODELS.register(
    "convnet",
    "two-conv CNN of McMahan et al. 2017 (conv5x5 32-64 pad 2, fc 512), any HxW >= 4",
    params=ConvNetParams,
)
def build_convnet(input_shape: tuple[int, ...], num_classes: int, p: ConvNetParams) -> FedModel:
    check_rank("convnet", input_shape, 3, "(1, 28, 28)")
    c1, c2 = p.channels
    convs = [conv_stage(input_shape[0], c1, padding=2), conv_stage(c1, c2, padding=2)]
    return conv_fc_model("convnet", input_shape, num_classes, convs, [p.hidden] if p.hidden else [])
