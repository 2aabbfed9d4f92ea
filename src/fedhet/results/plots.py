"""Figures for reports: learning curves over seeds and the label distribution of a partition.

Figures are drawn on an explicit Agg canvas instead of through pyplot, so importing fedhet never switches the
matplotlib backend of a notebook or GUI session, and nothing needs a display.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fedhet.errors import FedhetError
from fedhet.results.report import (
    FAMILIES,
    Group,
    Run,
    is_percent,
    method_and_setting,
)

METRIC_LABELS = {
    "test_acc": "test accuracy",
    "test_acc_ema": "test accuracy (EMA)",
    "client_dist_acc": "accuracy on client label distributions",
    "client_dist_acc_sampled": "accuracy on sampled client test sets",
    "local_risk": "local models' risk over client distributions",
    "local_kl": "local models' KL(P || Q)",
    "client_acc_mean": "mean client accuracy",
    "client_acc_worst10": "worst-10% client accuracy",
    "test_acc/domain/worst": "worst-domain accuracy",
    "personal_acc_macro": "personalised accuracy (macro)",
    "personal_acc_micro": "personalised accuracy (micro)",
    "train_loss": "training loss",
    "test_loss": "test loss",
    "attack/asr": "backdoor attack success rate",
    "privacy/epsilon": "privacy spent (epsilon)",
}
# Up to this many classes each gets its own colour in a stacked bar; beyond it a heat map reads better.
MAX_STACKED_CLASSES = 20


# Line styles cycle with the colours so that with up to 40 groups no two share a (colour, style) pair, and groups
# next to each other in the legend differ in both.
LINE_STYLES = ("-", "--", ":", "-.")
# `--panels family`: which family each algorithm is drawn with (report.FAMILIES); unknown names (plug-ins) go to
# "other". `--panels setting`: the config sections that describe the setting (report.SETTING_SECTIONS).
PANELS = ("family", "setting")
X_LABELS = {"round": "round", "sim/time": "simulated time (s)"}  # the x axes `fedhet report --x` names
# Several settings of one method in one axes (a grid without --panels setting) share the method's colour and line
# style and differ by marker.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
SMOOTHING = 0.9  # EMA factor for a metric without a recorded EMA in a run whose config has no run.ema


def plot_curves(
    groups: list[Group],
    path: str | Path,
    metric: str = "test_acc",
    title: str | None = None,
    smooth: bool = False,
    panels: str | None = None,
    x: str = "round",
) -> Path:
    """`metric` vs round (or ``x``), one line per group (mean over seeds, ±1 std band); see `curves_figure`."""
    return save(curves_figure(groups, metric, title, smooth, panels, x), path)


def curves_figure(
    groups: list[Group],
    metric: str = "test_acc",
    title: str | None = None,
    smooth: bool = False,
    panels: str | None = None,
    x: str = "round",
) -> Figure:
    """`metric` vs round (or the recorded metric ``x``, e.g. ``sim/time``): one line per group, the mean over seeds
    with a shaded ±1 std band.

    Each method keeps one line style whatever the panels, and its colour wherever it has one row per axes
    (``row_styles``, which the HTML page's swatches follow); rows of one method that share an axes (the settings of
    a grid) each get their own colour and a marker per setting. Each ± band's edges are drawn in its curve's colour
    and dashes, so overlapping bands stay apart. The legend, outside the axes so 20 groups hide no curve, lists the
    groups in the table's order. ``smooth`` plots the EMA the run recorded (``test_acc_ema``), or for another metric
    the same EMA (factor ``run.ema``) computed here. ``panels``: one panel per method family or per setting (the
    dataset, partition, model and training values that differ between groups). With ``x`` other than "round",
    each round's point sits at the seeds' mean of that metric (``sim/time``: the simulated seconds)."""
    if panels not in (None, *PANELS):
        raise FedhetError(f"unknown panels {panels!r}; choose one of: {', '.join(PANELS)}")
    methods, _ = method_and_setting(groups)
    style = row_styles(groups, panels)
    panel_of = panel_names(groups, panels)
    order = list(dict.fromkeys(panel_of))
    if panels == "family":
        order.sort(key=lambda name: list(FAMILIES).index(name) if name in FAMILIES else len(FAMILIES))
    fig, axes = panel_axes(len(order))
    scale = 100.0 if is_percent(metric) else 1.0
    drawn: dict[str, Any] = {}
    # overlapping std bands add up: fainter the more curves share an axes, so 20 bands do not turn to mud; each
    # band's edges are drawn in its curve's colour and dashes, so overlapping bands stay apart
    band_alpha = min(0.15, 0.25 / max(1, len(groups) / len(order)) ** 0.5)
    for i, group in enumerate(groups):
        method, panel = methods[i], panel_of[i]
        rounds, mean, std = seed_curve(group.runs, metric, smooth, x)
        if len(rounds) == 0:
            continue
        ax = axes[order.index(panel)]
        row = style[group.label]
        extra = {"marker": row.marker, "markevery": max(1, len(rounds) // 8), "markersize": 4} if row.marker else {}
        (line,) = ax.plot(rounds, mean * scale, color=row.colour, linestyle=row.dashes, linewidth=1.6, **extra)
        ax.fill_between(
            rounds,
            (mean - std) * scale,
            (mean + std) * scale,
            facecolor=to_rgba(row.colour, band_alpha),
            edgecolor=to_rgba(row.colour, 0.6),
            linestyle=row.dashes,
            linewidth=0.7,
        )
        if panels == "setting":  # the panel titles name the settings: one legend entry per method
            seeds = {len(g.runs) for g, m in zip(groups, methods, strict=True) if m == method}
            drawn.setdefault(method, (line, f"{method} (n={'/'.join(map(str, sorted(seeds)))})"))
        else:
            drawn.setdefault(group.label, (line, f"{group.label} (n={len(group.runs)})"))
    if not drawn:
        also = f" together with {x!r}" if x != "round" else ""
        raise FedhetError(f"no run recorded {metric!r}{also}; nothing to plot")
    label = METRIC_LABELS.get(metric, metric) + (" (smoothed)" if smooth and "ema" not in metric else "")
    for ax, panel in zip(axes, order, strict=True):
        ax.set_xlabel(X_LABELS.get(x, x))
        ax.set_ylabel(f"{label} (%)" if scale == 100.0 else label)
        if x == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if panels:
            ax.set_title(panel, fontsize="medium")
    fig.suptitle(title or f"{label} vs {X_LABELS.get(x, x)}")
    handles, names = zip(*drawn.values(), strict=True)
    fig.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 0.95), fontsize="small", frameon=False)
    return fig


def panel_names(groups: list[Group], panels: str | None) -> list[str]:
    """The panel each group is drawn in: its method's family, its setting, or "" (one axes)."""
    if panels == "family":
        return [family(str(g.settings.get("algorithm.name"))) for g in groups]
    if panels == "setting":
        return method_and_setting(groups)[1]
    return [""] * len(groups)


@dataclass(frozen=True)
class Style:
    colour: Any
    dashes: str
    marker: str | None = None


def row_styles(groups: list[Group], panels: str | None = None) -> dict[str, Style]:
    """Group label -> how its curve is drawn, and the colour of its swatch on the HTML page (with the same
    ``panels``). A method keeps one line style in every figure. Where rows of one method share an axes (settings of
    a grid drawn together), each row gets a colour of its own (in the table's order) and a marker per setting, so
    neither their curves, their ± bands nor their swatches look alike; elsewhere (one row per method in each axes,
    and ``--panels setting``, whose panels hold one setting each) a method keeps its colour (``method_styles``)."""
    methods, settings = method_and_setting(groups)
    per_method = method_styles(groups)
    panel_of = panel_names(groups, panels)
    if len(set(zip(panel_of, methods, strict=True))) == len(groups):
        return {label: Style(colour, dashes) for label, (colour, dashes) in per_method.items()}
    marker = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(dict.fromkeys(settings))}
    return {g.label: Style(row_colour(i), per_method[g.label][1], marker[settings[i]]) for i, g in enumerate(groups)}


def row_colour(i: int) -> Any:
    """The i-th of 20 distinct colours: tab10's, then tab20's lighter shade of each."""
    return colormaps["tab10"](i % 10) if i % 20 < 10 else colormaps["tab20"](2 * (i % 10) + 1)


def method_styles(groups: list[Group]) -> dict[str, tuple[Any, str]]:
    """Group label -> (colour, line style): one pair per method, in the order the methods first appear in the
    groups (the table's order), so a method looks the same in every figure and view of the same runs."""
    methods, _ = method_and_setting(groups)
    index = {m: i for i, m in enumerate(dict.fromkeys(methods))}
    return {g.label: pair(index[m]) for g, m in zip(groups, methods, strict=True)}


def colour_hex(colour: Any) -> str:
    """A matplotlib RGBA colour as #rrggbb (the HTML page's swatches)."""
    from matplotlib.colors import to_hex

    return to_hex(colour)


def pair(i: int) -> tuple[Any, str]:
    """The (colour, line style) of the i-th group: distinct for the first 40."""
    return colormaps["tab10"](i % 10), LINE_STYLES[(i + i // 10) % len(LINE_STYLES)]


def family(algorithm: str) -> str:
    return next((name for name, members in FAMILIES.items() if algorithm in members), "other")


def panel_axes(n: int) -> tuple[Figure, list[Any]]:
    cols = min(3, math.ceil(math.sqrt(n)))  # 2 x 2 for four families, at most three panels a row
    rows = -(-n // cols)
    fig = Figure(figsize=(5.2 * cols if n > 1 else 7.5, 3.8 * rows + 0.6 if n > 1 else 4.8), layout="constrained")
    axes = fig.subplots(rows, cols, sharey=True, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def seed_curve(
    runs: list[Run], metric: str, smooth: bool = False, x: str = "round"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rounds (or, for ``x`` other than "round", the seeds' mean of that metric at each round), mean and std over
    the seeds that recorded `metric` (and ``x``) at each round (std 0 with one seed)."""
    by_round: dict[int, list[float]] = defaultdict(list)
    at: dict[int, list[float]] = defaultdict(list)  # x's value of each of those seeds
    for run in runs:
        xs = dict(run.values(x)) if x != "round" else {}
        for rnd, value in smoothed(run, metric) if smooth else run.values(metric):
            if x != "round" and rnd not in xs:
                continue
            by_round[rnd].append(value)
            at[rnd].append(xs.get(rnd, rnd))
    rounds = sorted(by_round)
    values = [np.array(by_round[r], dtype=float) for r in rounds]
    mean = np.array([v.mean() for v in values])
    std = np.array([v.std(ddof=1) if len(v) > 1 else 0.0 for v in values])
    where = np.array(rounds) if x == "round" else np.array([np.mean(at[r]) for r in rounds])
    return where, mean, std


def smoothed(run: Run, metric: str) -> list[tuple[int, float]]:
    """The run's recorded EMA of `metric` (test_acc_ema), else the same EMA computed from its values."""
    if "ema" in metric or run.values(f"{metric}_ema"):
        return run.values(metric if "ema" in metric else f"{metric}_ema")
    factor = run.config.get("run", {}).get("ema", SMOOTHING)
    out, ema = [], None
    for rnd, value in run.values(metric):
        ema = value if ema is None else factor * ema + (1 - factor) * value
        out.append((rnd, ema))
    return out


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
    from fedhet.paths import check_output_file

    path = check_output_file(path, "plot file")  # a folder, FIFO, device or dangling link there is refused
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
