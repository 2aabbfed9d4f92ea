"""A client's own data on a SuperNode: one ``.npz`` file of model-ready arrays.

Arrays: ``x`` (inputs exactly as the model takes them, e.g. normalised float32 images ``(N, C, H, W)``), ``y`` (int
labels in ``[0, num_classes)``), ``num_classes``, and optionally ``x_test`` / ``y_test`` (the client's local test
split, used for personalised accuracy), and optionally ``pad_value`` (per channel, the value of a black pixel in
``x``'s normalised space, which crop and rotation augmentation fill the border with; 0 if absent).
``export_clients`` writes these files for every client of a fedhet
federation, which is how to try a data-path deployment (or hand each site its share of a benchmark).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedhet.config import Config
from fedhet.data.types import ClientData
from fedhet.errors import ConfigError


def client_file(out_dir: str | Path, cid: int) -> Path:
    return Path(out_dir) / f"client_{cid}.npz"


def export_clients(cfg: Config, out_dir: str | Path) -> list[Path]:
    """Write ``client_<id>.npz`` for every client of ``cfg``'s federation; returns the paths."""
    from fedhet.engine.training import build_federation, resolve_config

    resolve_config(cfg)
    fed = build_federation(cfg)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    paths = []
    for cid, c in enumerate(fed.clients):
        arrays = {"x": c.x.cpu().numpy(), "y": c.y.cpu().numpy(), "num_classes": np.int64(c.num_classes)}
        if c.y_test is not None:
            arrays.update(x_test=c.x_test.cpu().numpy(), y_test=c.y_test.cpu().numpy())
        if fed.pad_value is not None:
            arrays["pad_value"] = np.asarray(fed.pad_value, dtype=np.float64)
        path = client_file(out_dir, cid)
        np.savez(path, **arrays)
        paths.append(path)
    return paths


def load_client_file(
    path: str | Path, device: torch.device | str = "cpu"
) -> tuple[ClientData, tuple[float, ...] | None]:
    """A client's data from its ``.npz`` file, as tensors on ``device``, and its ``pad_value`` (None if absent)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"data-path {str(p)!r} does not exist on this node")
    with np.load(p, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    missing = {"x", "y", "num_classes"} - set(arrays)
    if missing:
        raise ConfigError(f"{p}: missing arrays {sorted(missing)} (expected x, y, num_classes[, x_test, y_test])")

    def tensor(name: str, long: bool = False) -> torch.Tensor | None:
        if name not in arrays:
            return None
        t = torch.from_numpy(np.ascontiguousarray(arrays[name]))
        return (t.long() if long else t).to(device)

    data = ClientData(
        x=tensor("x"),
        y=tensor("y", long=True),
        num_classes=int(arrays["num_classes"]),
        x_test=tensor("x_test"),
        y_test=tensor("y_test", long=True),
    )
    pad = arrays.get("pad_value")
    return data, None if pad is None else tuple(float(v) for v in np.ravel(pad))
