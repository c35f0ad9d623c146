"""``--plot PATH``: the benchmarks' figures, one PNG each (``pip install 'pdtrio[plot]'``).

matplotlib is an optional extra: it is imported here only when a figure is
drawn (Agg, no display), and a benchmark calls :func:`require_matplotlib`
before it starts measuring, so that a missing extra costs no run.  A panel is
a callable that draws on one ``Axes``; the two kinds the benchmarks share are
:func:`latency_cdfs` and :func:`throughput_vs_concurrency`.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.kit import quantile

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Panel = Callable[["Axes"], None]

MISSING = "--plot needs matplotlib: pip install 'pdtrio[plot]'"
# a spread wider than this (max / min) gets a log x axis
_LOG_SPREAD = 20.0


def require_matplotlib() -> None:
    """Exit with one line saying what to install when matplotlib is not there."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(MISSING)


def _scale_x(ax: Axes, values: Sequence[float]) -> None:
    """Log x when the spread is wide (symlog around 0 when there are values <= 0)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    magnitudes = sorted(abs(v) for v in values if v != 0)
    if not magnitudes or magnitudes[-1] / magnitudes[len(magnitudes) // 2] < _LOG_SPREAD / 4:
        return
    if min(values) > 0:
        if max(values) / min(values) < _LOG_SPREAD:
            return
        ax.set_xscale("log")
        # 1-2-5 ticks over a few decades; over more, they would run into each other
        decades = math.log10(max(values) / min(values))
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if decades < 3 else (1.0,)))
    else:
        # linear within the typical magnitude, log beyond it, both sides of 0
        linear = 10 ** math.floor(math.log10(magnitudes[len(magnitudes) // 2]))
        ax.set_xscale("symlog", linthresh=linear, linscale=0.5)
        ax.axvline(0, color="0.6", lw=0.8)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 100, not 10^2
    ax.xaxis.set_minor_formatter(NullFormatter())


def _short(value: float) -> str:
    """A latency in a few characters: 2168, 31.1, 0.42 (never 2.17e+03)."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def latency_cdfs(
    ax: Axes,
    series: Mapping[str, Sequence[float]],
    xlabel: str,
    *,
    title: str | None = None,
) -> None:
    """One empirical CDF per mode, p50 and p99 marked; a log x axis when the spread is wide.

    The marks are :func:`benchmarks.kit.quantile`'s, the p50/p99 every table prints.
    """
    _scale_x(ax, [v for samples in series.values() for v in samples])
    for mode, samples in series.items():
        ordered = sorted(samples)
        if not ordered:
            ax.plot([], [], label=f"{mode}: no samples")
            continue
        n = len(ordered)
        # from 0 at the smallest sample, up 1/n at each one
        fractions = [0.0] + [(i + 1) / n for i in range(n)]
        (line,) = ax.step([ordered[0], *ordered], fractions, where="post", lw=1.6)
        p50, p99 = quantile(ordered, 0.5), quantile(ordered, 0.99)
        ax.plot([p50], [0.5], "o", color=line.get_color(), ms=6)
        ax.plot([p99], [0.99], "^", color=line.get_color(), ms=7)
        line.set_label(f"{mode}: p50 {_short(p50)}, p99 {_short(p99)} (n={n})")
    for q in (0.5, 0.99):
        ax.axhline(q, color="0.75", lw=0.8, ls=":", zorder=0)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples ≤ x")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize="small", title="● p50  ▲ p99", title_fontsize="small")
    if title:
        ax.set_title(title, fontsize="medium")


def throughput_vs_concurrency(
    ax: Axes,
    series: Mapping[str, Sequence[tuple[int, float]]],
    *,
    reference: Mapping[str, Sequence[tuple[int, float]]] | None = None,
    ylabel: str = "tokens/s delivered",
    title: str | None = None,
) -> None:
    """Throughput against concurrency, one line per mode; ``reference`` lines (what was
    offered, say) dashed."""
    levels: set[int] = set()
    for style, lines in (("o-", series), ("x--", reference or {})):
        for mode, points in lines.items():
            ordered = sorted(points)
            levels.update(c for c, _ in ordered)
            color = "0.45" if style == "x--" else None  # references in grey
            ax.plot(
                [c for c, _ in ordered], [t for _, t in ordered], style, color=color, label=mode
            )
    if levels and max(levels) / max(1, min(levels)) > 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(levels), [str(c) for c in sorted(levels)])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title, fontsize="medium")


def save_figure(path: Path, *panels: Panel, title: str, columns: int = 3) -> Path:
    """The panels in a grid (``columns`` wide) under ``title``, written to ``path`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = max(1, min(columns, len(panels)))
    rows = max(1, math.ceil(len(panels) / columns))
    fig, axes = plt.subplots(
        rows, columns, figsize=(5.6 * columns, 4.4 * rows), squeeze=False, layout="constrained"
    )
    flat = [ax for row in axes for ax in row]
    for draw, ax in zip(panels, flat, strict=False):
        draw(ax)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
