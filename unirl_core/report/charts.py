"""Curves and histograms of the run report and the phase decks, drawn with matplotlib as inline SVG (offline, no
JavaScript).

Every chart has both axes with ticks and tick labels, a title, an axis label, the raw points and, optionally, an
exponential moving average (EMA) line. Texts stay ``<text>`` elements (``svg.fonttype='none'``), so the page is
searchable and small and tests read the tick labels from the SVG's structure (``matplotlib.axis_1`` /
``matplotlib.axis_2`` groups, ``xtick_N``, ``text_N``). The output is deterministic: ``svg.hashsalt`` is fixed per
chart and no date is written. Constrained layout keeps the tick and axis labels inside the figure whatever their
length. matplotlib is imported inside the chart functions (``import unirl_core`` stays fast); its figure API is
used without pyplot, and rendering holds a lock because ``rc_context`` sets process-wide parameters. Cost: ~0.05-0.15 s
of layout a chart on one core (the index draws ~10 every ``report.index_every_n_steps`` steps, a reward deck two
histograms every step).

Data lines carry ids: ``series_<i>`` for the i-th curve (``points`` first, then ``series`` in order) and ``ema``;
a histogram's bars are ``bar_<i>``.
"""

from __future__ import annotations

import html
import io
import math
import threading
from collections.abc import Sequence
from contextlib import contextmanager

MAX_POINTS = 500
"""Points drawn per series; longer runs are averaged into this many buckets, so a chart stays ~10-40 KB."""
MARKER_POINTS = 40
"""Series of at most this many points also draw a dot per point."""
COLORS = ("#3a6fc4", "#d9822b", "#3f9b5c", "#9b59b6", "#c0392b")
DPI = 96
"""Figure inches to CSS px: matplotlib's SVG is sized in pt (1/72 in), so a chart of ``width`` x ``height`` here
shows as that many CSS px (1 CSS px = 1/96 in)."""
_RC = {"svg.fonttype": "none", "path.simplify": False, "font.family": "sans-serif",
       "font.sans-serif": ["DejaVu Sans"], "axes.titlesize": 10, "axes.labelsize": 9, "xtick.labelsize": 8,
       "ytick.labelsize": 8}
"""Text as ``<text>`` in a sans-serif font (laid out with DejaVu Sans, which matplotlib ships; a browser without it
draws its own sans-serif), every point kept, and the report's font sizes."""
_LOCK = threading.Lock()

Points = Sequence[tuple[float, float]]


def finite(points: Points) -> list[tuple[float, float]]:
    """``points`` without NaN or infinite values."""
    return [(float(x), float(y)) for x, y in points if math.isfinite(float(y)) and math.isfinite(float(x))]


def ema(values: Sequence[float], alpha: float) -> list[float]:
    """Exponential moving average with smoothing ``alpha`` in [0, 1) (0 = no smoothing), bias-corrected so the
    first value is not pulled towards 0 (TensorBoard's smoothing)."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = alpha * acc + (1 - alpha) * v
        weight = alpha * weight + (1 - alpha)
        out.append(acc / weight)
    return out


def downsample(points: Points, limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most ``limit`` points: consecutive buckets averaged (the first and last step stay in place)."""
    pts = list(points)
    if len(pts) <= limit:
        return pts
    out = []
    for i in range(limit):
        chunk = pts[i * len(pts) // limit:(i + 1) * len(pts) // limit]
        out.append((sum(p[0] for p in chunk) / len(chunk), sum(p[1] for p in chunk) / len(chunk)))
    out[0], out[-1] = pts[0], pts[-1]
    return out


@contextmanager
def chart_style(salt: str):
    """The context every chart is built and saved in: the report's fonts, text as ``<text>``, every drawn point
    kept (no path simplification, so a curve's SVG path has one vertex per point), ``svg.hashsalt`` = ``salt``.
    Holds a lock: ``rc_context`` sets process-wide parameters."""
    import matplotlib

    with _LOCK, matplotlib.rc_context({**_RC, "svg.hashsalt": salt}):
        yield


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")


def _svg(fig, attrs: str) -> str:
    """``fig`` as an ``<svg>`` element (no XML declaration or doctype: it is inlined into HTML) with ``attrs``."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = buf.getvalue()
    return f"<svg {attrs} {svg[svg.index('<svg ') + len('<svg '):]}"


def line_chart_svg(points: Points, *, title: str, smooth: float | None = 0.6,
                   series: dict[str, Points] | None = None, ylabel: str = "", label: str | None = None,
                   width: int = 380, height: int = 220) -> str:
    """One chart as inline SVG: ``points`` (``(step, value)``) against the step, with axes, ticks and labels.

    ``smooth``: EMA smoothing drawn over the raw curve when there are at least 3 points (None: off).
    ``series``: further named curves on the same axes (e.g. ``ratio_min``/``ratio_max`` next to the mean), with a
    legend below the axes; ``label``: the legend name of ``points`` when there are series (default ``title``).
    Returns ``""`` when no point is finite. The root element carries ``class='curve'`` and ``data-metric``."""
    with chart_style(title):
        fig = line_chart_figure(points, title=title, smooth=smooth, series=series, ylabel=ylabel, label=label,
                                width=width, height=height)
        if fig is None:
            return ""
        style = "margin:4px;border:1px solid #ddd;vertical-align:top"
        return _svg(fig, f'class="curve" data-metric="{html.escape(title)}" style="{style}"')


def line_chart_figure(points: Points, *, title: str, smooth: float | None = 0.6,
                      series: dict[str, Points] | None = None, ylabel: str = "", label: str | None = None,
                      width: int = 380, height: int = 220):
    """The matplotlib ``Figure`` that ``line_chart_svg`` saves (None when no point is finite); build it inside
    ``chart_style``."""
    from matplotlib.ticker import MaxNLocator

    curves = {title: finite(points), **{k: finite(v) for k, v in (series or {}).items()}}
    curves = {k: sorted(v) for k, v in curves.items() if v}
    if not curves.get(title):
        return None
    main = curves[title]
    smoothed = (downsample(list(zip([p[0] for p in main], ema([p[1] for p in main], smooth), strict=True)))
                if smooth is not None and len(main) >= 3 else [])
    rows = (len(curves) + bool(smoothed) + 2) // 3 if series else 0
    fig = _figure(width, height + 14 * rows)
    ax = fig.add_subplot()
    for i, (name, pts) in enumerate(curves.items()):
        xs, ys = zip(*downsample(pts), strict=True)
        faded = bool(smoothed) and name == title
        ax.plot(xs, ys, color=COLORS[i % len(COLORS)], lw=1.2, alpha=0.35 if faded else 0.95,
                marker="o" if len(pts) <= MARKER_POINTS else None, ms=3, gid=f"series_{i}",
                label=(label or title) if name == title else name)
    if smoothed:
        ax.plot(*zip(*smoothed, strict=True), color=COLORS[0], lw=2, gid="ema", label=f"EMA {smooth:g}")
    ax.set_title(title)
    ax.set_xlabel("step")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.grid(True, color="#e4e4e4", lw=0.6)
    _set_limits(ax, [p for v in curves.values() for p in v] + smoothed)
    if series:  # several curves: the legend goes below the axes, never over the data
        fig.legend(loc="outside lower center", ncol=3, fontsize=6.5, frameon=False)
    elif smoothed:  # the EMA alone: in the corner that covers the fewest points
        ax.legend(handles=ax.get_lines()[-1:], loc="best", fontsize=6.5, framealpha=0.85, edgecolor="none")
    return fig


def _set_limits(ax, points: list[tuple[float, float]]) -> None:
    """A visible range around one step or a flat curve (equal up to rounding), instead of matplotlib's window of a
    few ulps whose tick labels differ only in the last digits."""
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    if x0 == x1:
        ax.set_xlim(x0 - 1, x1 + 1)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if y1 - y0 <= 1e-9 * max(1.0, abs(y0), abs(y1)):
        pad = max(abs(y0) * 0.05, 0.05)
        ax.set_ylim(y0 - pad, y1 + pad)


def histogram_svg(values: Sequence[float], *, title: str = "", bins: int = 12, width: int = 260,
                  height: int = 130) -> str:
    """A bar histogram with axes (value, count) as inline SVG; ``class='histogram'``, ``data-n`` = the number of
    finite values. Bins as numpy's ``histogram``: ``bins`` equal widths over [min, max], the last one closed; one
    distinct value gets the range value +- 0.5."""
    from matplotlib.ticker import MaxNLocator

    xs = [float(v) for v in values if math.isfinite(float(v))]
    if not xs:
        return "<svg class=\"histogram\" width=\"0\" height=\"0\"></svg>"
    lo, hi = min(xs), max(xs)
    with chart_style(f"hist-{title}-{len(xs)}"):
        fig = _figure(width, height)
        ax = fig.add_subplot()
        _, _, bars = ax.hist(xs, bins=bins, range=(lo - 0.5, hi + 0.5) if lo == hi else (lo, hi),
                             color=COLORS[0], edgecolor="white", lw=0.5)
        for i, bar in enumerate(bars):
            bar.set_gid(f"bar_{i}")
        ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.tick_params(labelsize=7)
        ax.set_ylabel("count", fontsize=7)
        if title:
            ax.set_title(title, fontsize=8)
        return _svg(fig, f'class="histogram" data-n="{len(xs)}"')
