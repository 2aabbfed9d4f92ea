"""Figures for reports: learning curves over seeds and the label distribution of a partition.

Figures are drawn on an explicit Agg canvas instead of through pyplot, so importing fedhet never switches the
matplotlib backend of a notebook or GUI session, and nothing needs a display.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedhet.errors import FedhetError
from fedhet.results.report import Group, Run

METRIC_LABELS = {
    "test_acc": "test accuracy",
    "test_acc_ema": "test accuracy (EMA)",
    "client_dist_acc": "accuracy on client label distributions",
    "client_dist_acc_sampled": "accuracy on sampled client test sets",
    "local_risk": "local models' risk over client distributions",
    "local_kl": "local models' KL(P || Q)",
    "client_acc_mean": "mean client accuracy",
    "client_acc_worst10": "worst-10% client accuracy",
    "personal_acc_macro": "personalised accuracy (macro)",
    "personal_acc_micro": "personalised accuracy (micro)",
    "train_loss": "training loss",
    "test_loss": "test loss",
}
# Up to this many classes each gets its own colour in a stacked bar; beyond it a heat map reads better.
MAX_STACKED_CLASSES = 20


def plot_curves(groups: list[Group], path: str | Path, metric: str = "test_acc", title: str | None = None) -> Path:
    """`metric` vs round, one line per group: mean over seeds with a shaded ±1 std band."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    scale = 100.0 if "acc" in metric else 1.0
    drawn = 0
    for group in groups:
        rounds, mean, std = seed_curve(group.runs, metric)
        if len(rounds) == 0:
            continue
        (line,) = ax.plot(rounds, mean * scale, label=f"{group.label} (n={len(group.runs)})", linewidth=1.5)
        band = (mean - std) * scale, (mean + std) * scale
        ax.fill_between(rounds, *band, color=line.get_color(), alpha=0.2, linewidth=0)
        drawn += 1
    if not drawn:
        raise FedhetError(f"no run recorded {metric!r}; nothing to plot")
    label = METRIC_LABELS.get(metric, metric)
    ax.set_xlabel("round")
    ax.set_ylabel(f"{label} (%)" if scale == 100.0 else label)
    ax.set_title(title or f"{label} vs round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return save(fig, path)


def seed_curve(runs: list[Run], metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rounds, mean and std over the seeds that recorded `metric` at each round (std 0 with one seed)."""
    by_round: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for rnd, value in run.values(metric):
            by_round[rnd].append(value)
    rounds = np.array(sorted(by_round))
    values = [np.array(by_round[r], dtype=float) for r in rounds]
    mean = np.array([v.mean() for v in values])
    std = np.array([v.std(ddof=1) if len(v) > 1 else 0.0 for v in values])
    return rounds, mean, std


def plot_label_distribution(
    counts: np.ndarray,
    path: str | Path,
    title: str = "label distribution",
    class_names: list[str] | None = None,
) -> Path:
    """Samples per (client, class): stacked bars for up to 20 classes, a heat map for more."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.size == 0 or (counts < 0).any():
        raise ValueError(f"counts must be a non-negative (clients x classes) array, got shape {counts.shape}")
    names = class_names or [str(c) for c in range(counts.shape[1])]
    fig = stacked_bars(counts, names) if counts.shape[1] <= MAX_STACKED_CLASSES else heat_map(counts)
    fig.axes[0].set_title(title)
    return save(fig, path)


def stacked_bars(counts: np.ndarray, names: list[str]) -> Figure:
    """One horizontal bar per client, one colour per class: shows label skew and client size at once."""
    clients, classes = counts.shape
    fig = Figure(figsize=(8, max(3.0, 0.15 * clients + 1.2)))
    ax = fig.subplots()
    palette = _palette(classes)
    left = np.zeros(clients)
    ids = np.arange(clients)
    for c in range(classes):
        ax.barh(ids, counts[:, c], left=left, height=0.85, color=palette[c], label=names[c], linewidth=0)
        left += counts[:, c]
    ax.set_ylim(clients - 0.5, -0.5)  # client 0 at the top
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(clients, 25)))
    ax.set_xlabel("samples")
    ax.set_ylabel("client")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(title="class", bbox_to_anchor=(1.01, 1), loc="upper left", fontsize="small")
    return fig


def heat_map(counts: np.ndarray) -> Figure:
    clients, classes = counts.shape
    fig = Figure(figsize=(max(6.0, 0.08 * classes + 2), max(3.0, 0.08 * clients + 1.5)))
    ax = fig.subplots()
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="samples")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    return fig


def _palette(n: int) -> list:
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i) for i in range(n)]


def save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
