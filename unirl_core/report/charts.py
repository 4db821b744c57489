"""Curves of the run report drawn with matplotlib as inline SVG (offline, no JavaScript).

Every chart has both axes with ticks and tick labels (text elements, ``svg.fonttype='none'``, so the page
stays searchable and small), a title, a step axis label, the raw points and, optionally, an exponential
moving average (EMA) line. The figure object API is used directly (no pyplot): no global backend state, safe
in any thread or process.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Sequence

MAX_POINTS = 500
"""Points drawn per series; longer runs are averaged into this many buckets, so a chart stays ~10-40 KB."""
MARKER_POINTS = 40
"""Series of at most this many points also draw a dot per point."""

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


def _svg_text(fig, salt: str) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt, "svg.image_inline": True}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML declaration and doctype: the SVG is inlined into HTML


def line_chart_svg(points: Points, *, title: str, smooth: float | None = 0.6,
                   series: dict[str, Points] | None = None, ylabel: str = "", label: str | None = None,
                   width: int = 380, height: int = 220) -> str:
    """One chart as inline SVG: ``points`` (``(step, value)``) against the step, with axes, ticks and labels.

    ``smooth``: EMA smoothing drawn over the raw curve when there are at least 3 points (None: off).
    ``series``: further named curves on the same axes (e.g. ``ratio_min``/``ratio_max`` next to the mean);
    ``label``: the legend name of ``points`` when there are series (default ``title``).
    Returns ``""`` when no point is finite. The root element carries ``class='curve'`` and ``data-metric``."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    curves = {title: finite(points), **{k: finite(v) for k, v in (series or {}).items()}}
    curves = {k: sorted(v) for k, v in curves.items() if v}
    if not curves.get(title):
        return ""
    dpi = 96  # SVG sizes are in pt (1/72 in); at 96 px per inch the chart is width x height CSS px
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    ax = fig.add_subplot()
    colors = ["#3a6fc4", "#d9822b", "#3f9b5c", "#9b59b6", "#c0392b"]
    main = curves[title]
    for i, (name, pts) in enumerate(curves.items()):
        xs, ys = zip(*downsample(pts))
        faded = smooth is not None and name == title and len(pts) >= 3
        ax.plot(xs, ys, color=colors[i % len(colors)], lw=1.2, alpha=0.35 if faded else 0.95,
                marker="o" if len(pts) <= MARKER_POINTS else None, ms=3,
                label=(label or name if name == title else name) if series else None)
    if smooth is not None and len(main) >= 3:
        xs = [p[0] for p in main]
        sm = downsample(list(zip(xs, ema([p[1] for p in main], smooth))))
        ax.plot([p[0] for p in sm], [p[1] for p in sm], color=colors[0], lw=2, label=f"EMA {smooth:g}")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=9)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.tick_params(labelsize=8)
    ax.grid(True, color="#e4e4e4", lw=0.6)
    lo = min(p[0] for pts in curves.values() for p in pts)
    hi = max(p[0] for pts in curves.values() for p in pts)
    if lo == hi:  # one step: a visible range around it instead of matplotlib's +-tiny window
        ax.set_xlim(lo - 1, hi + 1)
    if series or (smooth is not None and len(main) >= 3):
        if series:  # several curves: the legend goes below the axes, never over the data
            fig.set_size_inches(width / dpi, (height + 14 * ((len(curves) + 2) // 3)) / dpi)
            ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, frameon=False)
        else:
            ax.legend(fontsize=6.5, loc="best", framealpha=0.85, edgecolor="none")
    fig.tight_layout(pad=0.4)
    svg = _svg_text(fig, salt=title)
    attrs = f"class=\"curve\" data-metric=\"{html.escape(title)}\" style=\"margin:4px;border:1px solid #ddd\""
    return re.sub(r"^<svg ", f"<svg {attrs} ", svg, count=1)


def histogram_svg(values: Sequence[float], *, title: str = "", bins: int = 12, width: int = 260,
                  height: int = 130) -> str:
    """A bar histogram with axes (value, count) as inline SVG; ``class='histogram'``."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    xs = [float(v) for v in values if math.isfinite(float(v))]
    if not xs:
        return "<svg class=\"histogram\" width=\"0\" height=\"0\"></svg>"
    lo, hi = min(xs), max(xs)
    dpi = 96  # SVG sizes are in pt (1/72 in); at 96 px per inch the chart is width x height CSS px
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    ax = fig.add_subplot()
    ax.hist(xs, bins=bins, range=(lo - 0.5, hi + 0.5) if lo == hi else (lo, hi), color="#3a6fc4",
            edgecolor="white", lw=0.5)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.tick_params(labelsize=7)
    ax.set_ylabel("count", fontsize=7)
    if title:
        ax.set_title(title, fontsize=8)
    fig.tight_layout(pad=0.3)
    svg = _svg_text(fig, salt=f"hist-{title}-{len(xs)}")
    return re.sub(r"^<svg ", f"<svg class=\"histogram\" data-n=\"{len(xs)}\" ", svg, count=1)
