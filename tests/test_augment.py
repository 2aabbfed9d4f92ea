"""Augmentation on normalised batches: exact crops and flips, identity rotation, and a border filled with black."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedhet.data.augment import build_augment, random_crop, random_flip, random_rotate
from fedhet.data.datasets import load_dataset
from fedhet.data.federated import federate, normalise


def batch(seed: int = 0, n: int = 5, c: int = 2, size: int = 8) -> torch.Tensor:
    return torch.randn(n, c, size, size, generator=torch.Generator().manual_seed(seed))


def test_crop_is_a_shifted_window_of_the_padded_image_with_a_black_border():
    x, fill = batch(), torch.tensor([-1.5, -0.5])
    out = random_crop(x, torch.Generator().manual_seed(3), padding=2, fill=fill)
    g = torch.Generator().manual_seed(3)
    oy, ox = torch.randint(0, 5, (5,), generator=g), torch.randint(0, 5, (5,), generator=g)
    padded = fill.view(1, -1, 1, 1).expand(5, 2, 12, 12).clone()
    padded[:, :, 2:10, 2:10] = x
    for i in range(5):
        torch.testing.assert_close(out[i], padded[i, :, oy[i] : oy[i] + 8, ox[i] : ox[i] + 8], rtol=0, atol=1e-6)
    assert (oy != 2).any() or (ox != 2).any()  # at least one crop really moved


def test_crop_without_fill_pads_with_zero():
    x = torch.ones(64, 1, 4, 4)
    out = random_crop(x, torch.Generator().manual_seed(0), padding=4)
    assert set(out.unique().tolist()) == {0.0, 1.0}


def test_flip_mirrors_some_images_and_leaves_the_rest():
    x = batch(n=16)
    out = random_flip(x, torch.Generator().manual_seed(1))
    flipped = [torch.equal(o, i.flip(2)) for o, i in zip(out, x, strict=True)]
    kept = [torch.equal(o, i) for o, i in zip(out, x, strict=True)]
    assert all(f != k for f, k in zip(flipped, kept, strict=True)) and any(flipped) and any(kept)


def test_rotation_by_zero_is_identity_and_a_rotated_constant_image_gets_black_corners():
    x = batch()
    same = random_rotate(x, torch.Generator().manual_seed(0), degrees=0.0, fill=torch.tensor([-2.0, -1.0]))
    torch.testing.assert_close(same, x, rtol=0, atol=1e-5)
    const = torch.full((64, 1, 16, 16), 3.0)
    out = random_rotate(const, torch.Generator().manual_seed(0), degrees=30.0, fill=torch.tensor([-1.0]))
    torch.testing.assert_close(out[:, :, 6:10, 6:10], const[:, :, 6:10, 6:10])  # the centre stays inside
    assert out.min() < 0 and out.min() >= -1.0 - 1e-6  # corners blend towards the fill, never past it


def test_same_generator_same_augmentation():
    aug = build_augment("crop_flip_rotate", fill=[-1.0, -1.0])
    x = batch()
    a = aug(x, torch.Generator().manual_seed(7))
    b = aug(x, torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and not torch.equal(a, x)
    assert build_augment("none") is None


def test_non_image_batches_pass_through():
    x = torch.randn(4, 60)
    assert build_augment("crop")(x, torch.Generator()) is x


def test_federation_pad_value_is_a_black_pixel_after_normalisation():
    ds = load_dataset("digits")
    fed = federate(ds, [np.arange(100), np.arange(100, 200)])
    black = normalise(np.zeros((1, *ds.input_shape), np.float32), ds)
    assert fed.pad_value == pytest.approx([float(black[0, c].flat[0]) for c in range(ds.input_shape[0])])
    assert all(v < 0 for v in fed.pad_value)


def test_crop_fill_equals_padding_the_raw_image_before_normalising():
    """What torchvision does (RandomCrop on the raw image, then Normalize) is what we do on normalised batches."""
    ds = load_dataset("digits")
    fed = federate(ds, [np.arange(50)])
    raw = torch.from_numpy(ds.x_train[:8])
    mean, std = torch.tensor(ds.mean).view(1, -1, 1, 1), torch.tensor(ds.std).view(1, -1, 1, 1)
    ours = random_crop((raw - mean) / std, torch.Generator().manual_seed(2), 2, torch.tensor(fed.pad_value))
    theirs = (random_crop(raw, torch.Generator().manual_seed(2), 2) - mean) / std  # zero-padded raw image
    torch.testing.assert_close(ours, theirs)
