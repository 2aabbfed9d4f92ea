"""Moved to ``fedhet.toolkit.local`` and ``fedhet.algorithms.loop`` (the loop beside the contract that calls it);
kept so plug-ins importing it still work."""

from fedhet.algorithms.loop import train_locally  # noqa: F401
from fedhet.toolkit.local import (  # noqa: F401
    FlatSGD,
    batch_indices,
    clip_grad_norm,
    derive_seed,
    num_local_steps,
)
