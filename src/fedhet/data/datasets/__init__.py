"""Dataset loaders: one per on-disk format, each returning an :class:`ArrayDataset`.

Images come back as float32 NCHW in [0, 1], not normalised; ``mean``/``std`` hold the per-channel statistics
of the training split so the tensor layer can normalise.

One module per format family, each registering its loaders in ``DATASETS`` when imported: ``idx`` (MNIST,
Fashion-MNIST, EMNIST), ``cifar``, ``tinyimagenet``, ``generated`` (scikit-learn digits, Synthetic),
``shakespeare``, ``leaf`` (LEAF's JSON files: FEMNIST, CelebA, Sent140) and ``huggingface`` (Hugging Face datasets, a
hub id or a local copy); ``base`` holds the registry, the shared
parameters and the image helpers, ``files`` finding, downloading and reading the files (where fedhet looks for
them is described there).
"""

from __future__ import annotations

from pathlib import Path

# Importing the format modules registers their loaders, in the order of the single module this package was
# (kept out of isort's alphabetical order on purpose).
# isort: off
from fedhet.data.datasets import idx, cifar, tinyimagenet, generated, shakespeare, leaf, huggingface  # noqa: F401

# isort: on
from fedhet.data.datasets.base import DATASETS, NoParams
from fedhet.data.datasets.idx import read_idx
from fedhet.data.datasets.shakespeare import play_roles
from fedhet.data.types import ArrayDataset

__all__ = ["DATASETS", "NoParams", "load_dataset", "play_roles", "read_idx"]


def load_dataset(name: str, data_dir: str | Path | None = None, **params) -> ArrayDataset:
    """Load a registered dataset; an unknown name or parameter raises a ConfigError naming the valid ones."""
    return DATASETS.get(name).obj(data_dir, **params)
