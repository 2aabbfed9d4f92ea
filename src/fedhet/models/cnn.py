"""Small convolutional networks used by the papers fedhet reproduces.

Each body has stages `conv1`, `conv2`, `fc1`, ... whose names are the taps of `forward_features`. The flatten
size comes from a dry run on the input shape, so the same model works for 28x28 and 32x32 inputs.
"""

from __future__ import annotations

import torch.nn.functional as F
from pydantic import Field, NonNegativeInt, PositiveInt
from torch import Tensor, nn

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


class OneSampleBatchNorm:
    """BatchNorm that trains on a batch holding one value per channel (the short last batch of a pass can hold one
    sample), which PyTorch's refuses: such a batch has no batch statistics, so it is normalised with the running
    statistics, as in evaluation, and leaves them unchanged. Every other batch is PyTorch's BatchNorm."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.running_mean is not None and x.shape[0] * x[0, 0].numel() == 1:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return super().forward(x)


class BatchNorm1d(OneSampleBatchNorm, nn.BatchNorm1d):
    pass


class BatchNorm2d(OneSampleBatchNorm, nn.BatchNorm2d):
    pass


def conv_bn_stage(c_in: int, c_out: int, pool: bool) -> nn.Sequential:
    """conv5x5 (padding 2, size kept) -> BatchNorm -> ReLU [-> max-pool 2]."""
    layers = [nn.Conv2d(c_in, c_out, 5, padding=2), BatchNorm2d(c_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.MaxPool2d(2)) if pool else nn.Sequential(*layers)


def fc_bn_stage(d_in: int, d_out: int, flatten: bool = False) -> nn.Sequential:
    layers = [nn.Flatten()] if flatten else []
    return nn.Sequential(*layers, nn.Linear(d_in, d_out), BatchNorm1d(d_out), nn.ReLU())


class CNNBNParams(ModelParams):
    # output channels of the three conv5x5 layers: 64-64-128 in FedBN's digit model (Li et al. 2021, official
    # med-air/FedBN nets/models.py DigitModel)
    channels: tuple[PositiveInt, PositiveInt, PositiveInt] = (64, 64, 128)
    # widths of the fully connected layers, each followed by BatchNorm; the last is the embedding. FedBN's digit
    # model: 2048-512
    hidden: list[PositiveInt] = Field(default_factory=lambda: [2048, 512], min_length=1)


@MODELS.register(
    "cnn_bn",
    "FedBN's digit CNN (conv5x5 64-64-128, fc 2048-512, BatchNorm after every conv and fc), any HxW >= 4",
    params=CNNBNParams,
)
def build_cnn_bn(input_shape: tuple[int, ...], num_classes: int, p: CNNBNParams) -> FedModel:
    """Every convolution and hidden fully connected layer is followed by BatchNorm then ReLU; max-pooling after
    the first two convolutions (28x28 inputs: 128 x 7 x 7 = 6272 features into the first fc layer, as the paper's).
    A training batch of one sample is normalised with the running statistics (``OneSampleBatchNorm``)."""
    check_rank("cnn_bn", input_shape, 3, "(3, 28, 28)")
    c1, c2, c3 = p.channels
    convs = nn.Sequential(
        conv_bn_stage(input_shape[0], c1, pool=True), conv_bn_stage(c1, c2, pool=True), conv_bn_stage(c2, c3, False)
    )
    stages: dict[str, nn.Module] = {f"conv{i + 1}": conv for i, conv in enumerate(convs)}
    width = flat_size("cnn_bn", convs.eval(), input_shape)  # eval: one dry-run sample, normalised by the statistics
    convs.train()
    for i, out in enumerate(p.hidden):
        stages[f"fc{i + 1}"] = fc_bn_stage(width, out, flatten=i == 0)
        width = out
    return FedModel(stages, width, num_classes)
