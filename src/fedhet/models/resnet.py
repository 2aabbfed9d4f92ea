"""CIFAR-style ResNet-18 with GroupNorm, as used by FedRCL (Seo et al. 2024) and FedDecorr/MOON-style baselines.

Layout (official FedRCL ``models/resnet.py``, notes/fedrcl.md section 4): 3x3 stride-1 stem, no max-pool, four
stages of two BasicBlocks (widths w, 2w, 4w, 8w; strides 1, 2, 2, 2; 1x1-conv + norm shortcut when the shape
changes), global average pooling, a linear classifier with bias. Every norm is ``GroupNorm(2, C)`` by default
(FedRCL replaces BatchNorm, following Hsieh et al. 2020); BatchNorm is an option.

Stage taps. The body stages are ``conv1``, ``conv2_x``, ``conv3_x``, ``conv4_x``, ``conv5_x`` and ``pool``. Each
stage's output is taken *before* its final ReLU, and the ReLU is applied at the start of the next stage, so the
network computes exactly the usual function while ``forward_features`` returns the pre-ReLU stage outputs that the
official FedRCL code contrasts (``feature_relu: False``). ``relu(tap)`` is the post-ReLU feature. The embedding
(``pool``'s output) is the post-ReLU average-pooled 8w-d vector that feeds the classifier.
"""

from __future__ import annotations

from typing import Literal

from pydantic import PositiveInt, model_validator
from torch import Tensor, nn

from fedhet.models.base import MODELS, FedModel, ModelParams, check_rank

# The stages FedRCL applies its multi-level loss to (paper Sec. 4.4: conv1, conv2_x .. conv5_x of ResNet-18).
RESNET_LEVELS = ("conv1", "conv2_x", "conv3_x", "conv4_x", "conv5_x")


class ResNetParams(ModelParams):
    norm: Literal["group", "batch"] = "group"  # FedRCL: GroupNorm in place of BatchNorm (paper Sec. 5.1)
    groups: PositiveInt = 2  # official FedRCL code: nn.GroupNorm(2, C) everywhere (the paper gives no count)
    width: PositiveInt = 64  # channels of the first stage; 64 is ResNet-18, smaller widths make CPU runs practical

    @model_validator(mode="after")
    def _groups_divide_width(self) -> ResNetParams:
        if self.norm == "group" and self.width % self.groups:
            raise ValueError(f"width {self.width} must be a multiple of groups {self.groups}")
        return self


def make_norm(p: ResNetParams, channels: int) -> nn.Module:
    return nn.GroupNorm(p.groups, channels) if p.norm == "group" else nn.BatchNorm2d(channels)


class BasicBlock(nn.Module):
    """conv3x3-norm-ReLU-conv3x3-norm plus the shortcut; the closing ReLU belongs to whoever consumes the output."""

    def __init__(self, c_in: int, c_out: int, stride: int, p: ResNetParams) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = make_norm(p, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = make_norm(p, c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), make_norm(p, c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn1(self.conv1(x)).relu()
        return self.bn2(self.conv2(out)) + self.shortcut(x)


def residual_stage(c_in: int, c_out: int, stride: int, p: ResNetParams, blocks: int = 2) -> nn.Sequential:
    """ReLU of the previous stage's output, then the blocks; a ReLU between blocks, none after the last one."""
    layers: list[nn.Module] = [nn.ReLU()]
    for i in range(blocks):
        if i:
            layers.append(nn.ReLU())
        layers.append(BasicBlock(c_in if i == 0 else c_out, c_out, stride if i == 0 else 1, p))
    return nn.Sequential(*layers)


@MODELS.register(
    "resnet18",
    "CIFAR ResNet-18 (3x3 stem, no max-pool), GroupNorm(2) or BatchNorm, width option; pre-ReLU stage taps "
    "conv1, conv2_x..conv5_x (FedRCL, skynbe/FedRCL models/resnet.py)",
    params=ResNetParams,
)
def build_resnet18(input_shape: tuple[int, ...], num_classes: int, p: ResNetParams) -> FedModel:
    check_rank("resnet18", input_shape, 3, "(3, 32, 32)")
    w = p.width
    stages = {
        "conv1": nn.Sequential(nn.Conv2d(input_shape[0], w, 3, 1, 1, bias=False), make_norm(p, w)),
        "conv2_x": residual_stage(w, w, 1, p),
        "conv3_x": residual_stage(w, 2 * w, 2, p),
        "conv4_x": residual_stage(2 * w, 4 * w, 2, p),
        "conv5_x": residual_stage(4 * w, 8 * w, 2, p),
        "pool": nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()),
    }
    model = FedModel(stages, 8 * w, num_classes)
    model.contrastive_levels = RESNET_LEVELS  # read by FedRCL when its `levels` option is left unset
    return model
