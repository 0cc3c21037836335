"""PNG plots of the scale benchmarks, from plain lists (so a result can be re-plotted from its JSON).

matplotlib is an optional extra: it is imported only when a plot is drawn, so ``dsec --help`` and the
other benches stay fast and work without it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

MISSING = "matplotlib is needed to draw the bench's plots: pip install 'dsec[bench]'"
SIZE = (8.0, 4.5)
DPI = 100


def _pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(MISSING) from None
    # no display here, and the default backend may probe for one
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def available() -> bool:
    try:
        _pyplot()
    except RuntimeError:
        return False
    return True


def _save(fig: Any, ax: Any, path: Path, title: str, *others: Any) -> Path:
    """Title, grid, one legend for ``ax`` and any twin axes (``others``), then the PNG."""
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    for other in others:
        more = other.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if handles:
        ax.legend(handles, labels, loc="best", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    _pyplot().close(fig)
    return path


def lines(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    right: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    right_label: str = "",
    steps: bool = False,
) -> Path:
    """One line per series (x, y); ``right``: series on a second y axis (another unit)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=SIZE)
    draw = "step" if steps else "plot"
    for label, (x, y) in series.items():
        getattr(ax, draw)(list(x), list(y), label=label, **({"where": "post"} if steps else {}))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if not right:
        return _save(fig, ax, path, title)
    ax2 = ax.twinx()
    for i, (label, (x, y)) in enumerate(right.items()):
        ax2.plot(list(x), list(y), label=label, linestyle="--", color=f"C{len(series) + i}")
    ax2.set_ylabel(right_label)
    ax2.set_ylim(bottom=0)
    return _save(fig, ax, path, title, ax2)


def rolling_median(values: Sequence[float], window: int) -> list[float]:
    """The median of the ``window`` values ending at each point (fewer at the start)."""
    out: list[float] = []
    ordered: list[float] = []
    for i, v in enumerate(values):
        bisect.insort(ordered, v)
        if i >= window:
            ordered.pop(bisect.bisect_left(ordered, values[i - window]))
        mid = len(ordered) // 2
        out.append(ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2)
    return out


def scatter(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    log_y: bool = False,
    window: int = 0,
) -> Path:
    """Points per series, and with ``window`` their rolling median as a line (the trend through noise)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=SIZE)
    for i, (label, (x, y)) in enumerate(series.items()):
        ax.scatter(list(x), list(y), s=4, alpha=0.35, color=f"C{i}", label=label)
        if window and len(y) > 1:
            ax.plot(list(x), rolling_median(list(y), window), color=f"C{i}", linewidth=1.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y and any(v > 0 for _, y in series.values() for v in y):
        ax.set_yscale("log")
    return _save(fig, ax, path, title)


def cdf(
    path: Path,
    title: str,
    samples_ms: Mapping[str, Sequence[float]],
    *,
    log_x: bool = True,
    ylabel: str = "share of creations at or below",
) -> Path:
    """Empirical CDF per series (milliseconds): where p50 and p99 sit, and how far the tail goes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=SIZE)
    for label, values in samples_ms.items():
        ordered = sorted(values)
        if not ordered:
            continue
        frac = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, frac, where="post", label=f"{label} (n={len(ordered)})")
    for q in (0.5, 0.99):
        ax.axhline(q, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("milliseconds")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    if log_x and any(v > 0 for values in samples_ms.values() for v in values):
        ax.set_xscale("log")
    return _save(fig, ax, path, title)


def rate(path: Path, title: str, done_at: Mapping[str, Sequence[float]], *, bin_s: float = 0.0) -> Path:
    """Completions per second over time, per series (``done_at``: seconds since the start of each event)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=SIZE)
    end = max((max(v) for v in done_at.values() if v), default=1.0)
    width = bin_s or max(0.1, end / 60)
    bins = max(1, math.ceil(end / width))
    for label, times in done_at.items():
        counts = [0] * bins
        for t in times:
            counts[min(bins - 1, int(t / width))] += 1
        ax.step([i * width for i in range(bins)], [c / width for c in counts], where="post", label=label)
    ax.set_xlabel("seconds since the burst started")
    ax.set_ylabel("per second")
    ax.set_ylim(bottom=0)
    return _save(fig, ax, path, title)


def cumulative(path: Path, title: str, done_at: Mapping[str, Sequence[float]]) -> Path:
    """How many were done by each moment, per series."""
    series = {}
    for label, times in done_at.items():
        ordered = sorted(times)
        series[label] = ([0.0, *ordered], [0.0, *range(1, len(ordered) + 1)])
    return lines(path, title, "seconds since the burst started", "done", series, steps=True)


def bars(
    path: Path, title: str, ylabel: str, groups: Mapping[str, Mapping[str, float]], *, log_y: bool = False
) -> Path:
    """Grouped bars: one group per measure (the inner keys), one bar per series (the outer keys) in each;
    ``log_y`` where the bars differ by orders of magnitude (a missing bar is then left out, not drawn at 0)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=SIZE)
    measures = list(dict.fromkeys(m for values in groups.values() for m in values))
    width = 0.8 / max(1, len(groups))
    for i, (label, values) in enumerate(groups.items()):
        x = [j + i * width for j in range(len(measures))]
        heights = [values.get(m, math.nan if log_y else 0.0) for m in measures]
        ax.bar(x, heights, width, label=label, color=f"C{i}")
    if log_y and any(v > 0 for values in groups.values() for v in values.values()):
        ax.set_yscale("log")
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(measures))])
    ax.set_xticklabels(measures)
    ax.set_ylabel(ylabel)
    return _save(fig, ax, path, title)
