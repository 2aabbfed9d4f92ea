"""ResNet-18 (CIFAR layout, GroupNorm(2)): size, norms, pre-ReLU stage taps, and the usual forward function."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedhet.errors import ConfigError
from fedhet.models import build_model
from fedhet.models.resnet import RESNET_LEVELS, BasicBlock
from fedhet.toolkit.flat import FlatModel


def test_full_width_has_resnet18_parameter_count():
    model = build_model("resnet18", (3, 32, 32), 10)
    # The CIFAR ResNet-18 (kuangliu/pytorch-cifar, FedRCL's ResNet18_base): 11,173,962 parameters. GroupNorm has
    # the same per-channel affine parameters as BatchNorm, so the count does not depend on the norm.
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
    assert model.embedding_dim == 512 and model.head.bias is not None


def test_group_norm_with_two_groups_everywhere_and_no_buffers():
    model = build_model("resnet18", (3, 32, 32), 10, width=8)
    norms = [m for m in model.modules() if isinstance(m, (nn.GroupNorm, nn.BatchNorm2d))]
    assert len(norms) == 1 + 8 * 2 + 3  # stem, two per block, three projection shortcuts
    assert all(isinstance(m, nn.GroupNorm) and m.num_groups == 2 for m in norms)
    assert FlatModel(model).buffers.numel() == 0  # GroupNorm keeps no running statistics to average


def test_batch_norm_option():
    model = build_model("resnet18", (3, 32, 32), 10, width=8, norm="batch")
    assert not any(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert FlatModel(model).buffers.numel() > 0


@pytest.mark.parametrize("shape", [(3, 32, 32), (3, 64, 64), (1, 28, 28)])
def test_stage_taps_shapes(shape):
    w = 4
    model = build_model("resnet18", shape, 7, width=w)
    assert model.feature_names == (*RESNET_LEVELS, "embedding")
    assert model.contrastive_levels == RESNET_LEVELS
    x = torch.randn(2, *shape)
    logits, feats = model.forward_features(x)
    h = shape[1]
    expected = {
        "conv1": (w, h),  # 3x3 stride-1 stem, no max-pool
        "conv2_x": (w, h),
        "conv3_x": (2 * w, (h + 1) // 2),
        "conv4_x": (4 * w, (h + 3) // 4),
        "conv5_x": (8 * w, (h + 7) // 8),
    }
    for name, (c, size) in expected.items():
        assert feats[name].shape == (2, c, size, size), name
    assert feats["embedding"].shape == (2, 8 * w) and logits.shape == (2, 7)


def reference_forward(model, x):
    """The textbook ResNet forward: ReLU after the stem and after every block, pool, classifier."""
    body = model.body
    out = torch.relu(body.conv1(x))
    for stage in ("conv2_x", "conv3_x", "conv4_x", "conv5_x"):
        for block in (m for m in getattr(body, stage) if isinstance(m, BasicBlock)):
            out = torch.relu(block(out))
    return model.head(out.mean((2, 3)))


def test_taps_are_pre_relu_and_the_function_is_the_usual_resnet():
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 32, 32), 10, width=8).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        logits, feats = model.forward_features(x)
        torch.testing.assert_close(logits, reference_forward(model, x))
        torch.testing.assert_close(feats["conv1"], model.body.conv1[1](model.body.conv1[0](x)))
        torch.testing.assert_close(feats["embedding"], torch.relu(feats["conv5_x"]).mean((2, 3)))
    assert all((feats[name] < 0).any() for name in RESNET_LEVELS)  # before the ReLU, so negatives remain


def test_width_must_split_into_groups():
    with pytest.raises(ConfigError, match="multiple of groups"):
        build_model("resnet18", (3, 32, 32), 10, width=7)
    with pytest.raises(ConfigError, match=r"\(3, 32, 32\)"):
        build_model("resnet18", (60,), 10)
