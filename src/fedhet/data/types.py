"""Plain data types shared by the data layer: what a loader returns and what a partitioner returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedhet.errors import FedhetError


class DataError(FedhetError, ValueError):
    """A dataset, partition or data parameter problem, with a message meant for the user.

    The message is kept to one line: line breaks (as in some library errors it quotes) become "; "."""

    def __init__(self, message: str) -> None:
        super().__init__("; ".join(part.strip() for part in str(message).splitlines() if part.strip()))


@dataclass
class ArrayDataset:
    """Raw arrays of one dataset plus the metadata the rest of fedhet needs.

    Images are float32 ``(N, C, H, W)`` scaled to [0, 1] and *not* normalised (``mean``/``std`` are applied when the
    data is moved into tensors). Tabular data is float32 ``(N, D)``; character sequences are int64 ``(N, L)``.
    Labels are int64 ``(N,)`` in ``[0, num_classes)``.

    ``groups_train`` / ``groups_test`` hold a natural client id per sample (Shakespeare role, Synthetic user) for
    datasets that come already split by user; ``None`` otherwise. A dataset with no official test set has empty
    ``x_test``/``y_test`` and ``has_test_set = False``; its global test set is then the union of the clients' local
    test splits.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    task: str = "image"  # "image" | "tabular" | "sequence"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    class_names: list[str] | None = None
    groups_train: np.ndarray | None = None
    groups_test: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    @property
    def has_test_set(self) -> bool:
        return len(self.y_test) > 0

    def __post_init__(self) -> None:
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise DataError(f"dataset {self.name!r}: inputs and labels have different lengths")
