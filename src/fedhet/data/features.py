"""Feature-distribution skew: the same label looks different on different clients.

A *feature skew* is a deterministic function of (client, sample, seed) applied to the clients' raw inputs (images in
[0, 1] before normalisation, tabular features) when the federation is built, so the training loop, the executors and
a Flower node never know about it. It composes with any partitioner: the partitioner decides which samples a client
holds, the feature skew how they look.

Two families:

* **noise** (NIID-Bench, Li et al. 2022): client i of N (1-based, as the paper numbers its parties) adds Gaussian
  noise of std ``sigma * i / N`` to its training and local test inputs, drawn once from (seed, client), so a sample
  keeps its noise for the whole run. The global test set stays clean.
* **domains**: K domains, each a transform of the input (rotation by ``k * 360 / K`` degrees, contrast, inversion,
  blur, hue), and each client belongs to one (``blocks``: clients ``i * K // N``; ``round_robin``: ``i mod K``). A
  client's training and local test data are in its domain; the global test set is evaluated once per domain (its K
  transformed copies), which gives ``test_acc/domain/<k>`` and the worst domain. A dataset that carries a domain per
  sample (a writer, a hospital, a camera) gives **natural** domains instead: nothing is transformed, and the global
  test set is scored per domain the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.data.datasets import NoParams
from fedhet.data.types import ArrayDataset, DataError
from fedhet.errors import ConfigError
from fedhet.registry import Registry

FEATURE_SKEWS = Registry("feature skew", section="features")

Assign = Literal["blocks", "round_robin"]


class NoiseParams(NoParams):
    sigma: float = Field(0.1, gt=0)  # NIID-Bench's noise level (its experiments use 0.1)


class DomainParams(NoParams):
    domains: int = Field(4, ge=2)  # K
    assign: Assign = "blocks"  # clients i * K // N ("blocks") or i mod K ("round_robin")


class ContrastParams(DomainParams):
    min_contrast: float = Field(0.2, gt=0, lt=1)  # domain k scales contrast by 1 - k (1 - min_contrast) / (K - 1)


class BlurParams(DomainParams):
    max_sigma: float = Field(2.0, gt=0)  # domain k blurs with a Gaussian of std k * max_sigma / (K - 1) pixels


class InvertParams(NoParams):
    assign: Assign = "blocks"  # two domains: the inputs as they are, and inverted (1 - x)


@dataclass(frozen=True)
class FeatureSkew:
    """What a feature skew does to a federation: each client's domain, and how a client's inputs change."""

    name: str
    params: dict
    domain_names: tuple[str, ...] = ()  # empty: no per-domain evaluation (noise)
    client_domains: tuple[int, ...] = ()  # the domain of each client (domain transforms)

    @property
    def transforms_test_set(self) -> bool:
        """Whether the global test set is scored as one transformed copy per domain."""
        return bool(self.domain_names) and self.name != "natural"

    def client(self, x: torch.Tensor, client: int, num_clients: int, seed: int, role: int) -> torch.Tensor:
        """Client ``client``'s inputs ``x`` (its training data for ``role`` 0, its local test data for 1, its
        validation data for 2: held out of its training share, so transformed alike, with noise of its own)."""
        if self.name == "noise":
            std = self.params["sigma"] * (client + 1) / num_clients
            gen = torch.Generator().manual_seed(_seed(seed, client, role))
            return x + std * torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
        if self.client_domains:
            return self.domain(x, self.client_domains[client])
        return x

    def domain(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Inputs ``x`` moved to domain ``k`` (domain 0 is the data as they are)."""
        if k == 0 or self.name == "natural":
            return x
        return DOMAIN_TRANSFORMS[self.name](x, k, len(self.domain_names), self.params)


def _seed(seed: int, client: int, role: int) -> int:
    """A 63-bit seed from (run seed, client, train/test), the same in every process."""
    return int(np.random.SeedSequence([seed, client, role, 0xFEA7]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def assign_domains(num_clients: int, k: int, assign: str) -> tuple[int, ...]:
    if assign == "round_robin":
        return tuple(i % k for i in range(num_clients))
    return tuple(i * k // num_clients for i in range(num_clients))


# ----------------------------------------------------------------------------------------------------------
# Domain transforms on float (N, C, H, W) images in [0, 1]


def rotate(x: torch.Tensor, k: int, num: int, params: dict) -> torch.Tensor:
    """Rotation by ``k * 360 / K`` degrees counter-clockwise about the centre; corners that come from outside the
    image are black. Quarter turns of a square image are exact (no interpolation)."""
    angle = k * 360.0 / num
    if angle % 90 == 0 and x.shape[-1] == x.shape[-2]:
        return torch.rot90(x, int(angle // 90), dims=(-2, -1)).contiguous()
    theta = math.radians(angle)
    cos, sin = math.cos(theta), math.sin(theta)
    h, w = x.shape[-2:]
    # grid_sample's coordinates are normalised per axis; the aspect ratio keeps a non-square rotation rigid
    affine = torch.tensor([[cos, -sin * h / w, 0.0], [sin * w / h, cos, 0.0]], dtype=x.dtype, device=x.device)
    grid = F.affine_grid(affine.expand(len(x), 2, 3), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def contrast(x: torch.Tensor, k: int, num: int, params: dict) -> torch.Tensor:
    """Contrast scaled by ``f_k = 1 - k (1 - min_contrast) / (K - 1)`` about each image's mean per channel."""
    f = 1.0 - k * (1.0 - params["min_contrast"]) / (num - 1)
    mean = x.mean(dim=(-2, -1), keepdim=True)
    return mean + f * (x - mean)


def invert(x: torch.Tensor, k: int, num: int, params: dict) -> torch.Tensor:
    """``1 - x``: dark strokes on a light ground become light strokes on a dark one."""
    return 1.0 - x


def blur(x: torch.Tensor, k: int, num: int, params: dict) -> torch.Tensor:
    """A Gaussian blur of std ``k * max_sigma / (K - 1)`` pixels, separable, edges reflected."""
    sigma = k * params["max_sigma"] / (num - 1)
    radius = max(1, math.ceil(3 * sigma))
    radius = min(radius, x.shape[-1] - 1, x.shape[-2] - 1)
    t = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    kernel = torch.exp(-0.5 * (t / sigma) ** 2)
    kernel = kernel / kernel.sum()
    c = x.shape[1]
    out = F.pad(x, (radius, radius, 0, 0), mode="reflect")
    out = F.conv2d(out, kernel.view(1, 1, 1, -1).expand(c, 1, 1, -1).contiguous(), groups=c)
    out = F.pad(out, (0, 0, radius, radius), mode="reflect")
    return F.conv2d(out, kernel.view(1, 1, -1, 1).expand(c, 1, -1, 1).contiguous(), groups=c)


def hue(x: torch.Tensor, k: int, num: int, params: dict) -> torch.Tensor:
    """A hue rotation by ``k * 360 / K`` degrees: RGB turned about the grey axis (grey stays grey), clipped to
    [0, 1]."""
    theta = math.radians(k * 360.0 / num)
    cos, sin, third = math.cos(theta), math.sin(theta), 1.0 / 3.0
    root = math.sqrt(third)
    a = cos + (1 - cos) * third
    b = (1 - cos) * third - root * sin
    c = (1 - cos) * third + root * sin
    matrix = torch.tensor([[a, b, c], [c, a, b], [b, c, a]], dtype=x.dtype, device=x.device)
    return torch.einsum("ij,njhw->nihw", matrix, x).clamp_(0.0, 1.0)


DOMAIN_TRANSFORMS = {"rotation": rotate, "contrast": contrast, "invert": invert, "blur": blur, "colour": hue}


# ----------------------------------------------------------------------------------------------------------
# Registered feature skews: fn(dataset, num_clients, **params) -> FeatureSkew


def _needs_images(name: str, ds: ArrayDataset, channels: int | None = None) -> None:
    if ds.task != "image" or ds.x_train.ndim != 4:
        raise DataError(
            f"features.name={name!r} transforms images, and dataset {ds.name!r} holds {ds.task} inputs; "
            f"for them use {valid_for(ds)}"
        )
    if channels is not None and ds.x_train.shape[1] != channels:
        raise DataError(
            f"features.name={name!r} needs {channels}-channel (RGB) images, and dataset {ds.name!r} has "
            f"{ds.x_train.shape[1]}; for it use {valid_for(ds)}"
        )


def valid_for(ds: ArrayDataset) -> str:
    """The feature skews that fit ``ds``'s inputs, for an error message."""
    names = ["none"]
    if np.issubdtype(ds.x_train.dtype, np.floating):
        names.append("noise")
    if ds.task == "image" and ds.x_train.ndim == 4:
        names += ["rotation", "contrast", "invert", "blur"] + (["colour"] if ds.x_train.shape[1] == 3 else [])
    if ds.domains_train is not None:
        names.append("natural")
    return ", ".join(names)


@FEATURE_SKEWS.register("none", "no feature skew: every client's inputs as the dataset has them")
def no_skew(ds: ArrayDataset, num_clients: int) -> FeatureSkew:
    return FeatureSkew("none", {})


@FEATURE_SKEWS.register("noise", "Gaussian noise of std sigma * i / N on client i's inputs (NIID-Bench)", NoiseParams)
def noise_skew(ds: ArrayDataset, num_clients: int, sigma: float = 0.1) -> FeatureSkew:
    if not np.issubdtype(ds.x_train.dtype, np.floating):
        raise DataError(
            f"features.name='noise' adds Gaussian noise to real-valued inputs, and dataset {ds.name!r} holds "
            f"{ds.x_train.dtype} token ids; for it use {valid_for(ds)}"
        )
    return FeatureSkew("noise", {"sigma": sigma})


def _domain_skew(name: str, ds: ArrayDataset, num_clients: int, domains: int, assign: str, **params) -> FeatureSkew:
    _needs_images(name, ds, channels=3 if name == "colour" else None)
    if domains > num_clients and name != "invert":
        # a domain without a client trains nobody, and the test set is copied once per domain: a huge K would
        # build K copies of it before the first round
        raise ConfigError(
            f"features.domains={domains} is more than the {num_clients} clients (partition.num_clients): every "
            f"domain is some client's; use at most {num_clients} domains"
        )
    names = tuple(str(k) for k in range(domains))
    return FeatureSkew(name, params, names, assign_domains(num_clients, domains, assign))


@FEATURE_SKEWS.register("rotation", "K domains, domain k rotated by k * 360 / K degrees", DomainParams)
def rotation_skew(ds: ArrayDataset, num_clients: int, domains: int = 4, assign: str = "blocks") -> FeatureSkew:
    return _domain_skew("rotation", ds, num_clients, domains, assign)


@FEATURE_SKEWS.register("contrast", "K domains of decreasing contrast, from 1 to min_contrast", ContrastParams)
def contrast_skew(ds, num_clients, domains=4, assign="blocks", min_contrast=0.2) -> FeatureSkew:
    return _domain_skew("contrast", ds, num_clients, domains, assign, min_contrast=min_contrast)


@FEATURE_SKEWS.register("blur", "K domains of increasing Gaussian blur, up to max_sigma pixels", BlurParams)
def blur_skew(ds, num_clients, domains=4, assign="blocks", max_sigma=2.0) -> FeatureSkew:
    return _domain_skew("blur", ds, num_clients, domains, assign, max_sigma=max_sigma)


@FEATURE_SKEWS.register("invert", "two domains: the images as they are and inverted (1 - x)", InvertParams)
def invert_skew(ds: ArrayDataset, num_clients: int, assign: str = "blocks") -> FeatureSkew:
    return _domain_skew("invert", ds, num_clients, 2, assign)


@FEATURE_SKEWS.register("colour", "K domains of RGB images, domain k's hue turned by k * 360 / K degrees", DomainParams)
def colour_skew(ds: ArrayDataset, num_clients: int, domains: int = 4, assign: str = "blocks") -> FeatureSkew:
    return _domain_skew("colour", ds, num_clients, domains, assign)


@FEATURE_SKEWS.register("natural", "the dataset's own domain per sample (writer, hospital, camera), scored per domain")
def natural_skew(ds: ArrayDataset, num_clients: int) -> FeatureSkew:
    if ds.domains_train is None:
        raise DataError(
            f"features.name='natural' needs a dataset with a domain per sample, and {ds.name!r} has none; "
            f"for it use {valid_for(ds)}"
        )
    return FeatureSkew("natural", {}, tuple(ds.domain_names or ()))


def feature_skew(name: str, ds: ArrayDataset, num_clients: int, **params) -> FeatureSkew:
    """The named feature skew for ``ds`` split across ``num_clients`` (parameters validated by the registry)."""
    entry, parsed = FEATURE_SKEWS.parse(name, params)
    return entry.obj(ds, num_clients, **(parsed.model_dump() if parsed is not None else {}))
