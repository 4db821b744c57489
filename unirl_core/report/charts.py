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


def nice_ticks(lo: float, hi: float, nbins: int, *, integer: bool = False) -> list[float]:
    """Round values inside ``[lo, hi]`` at most ``nbins`` intervals apart over the range (steps of 1, 2, 2.5 or 5
    times a power of ten; ``integer``: whole steps of 1, 2 or 5 times a power of ten), as matplotlib's
    ``MaxNLocator(nbins)`` picks them."""
    span = hi - lo
    raw = span / max(nbins, 1)
    if integer:
        raw = max(raw, 1.0)
    mag = 10 ** math.floor(math.log10(raw))
    steps = (1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)
    step = next(m * mag for m in steps if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(lo / step - 1e-9)
    ticks = [(first + k) * step for k in range(math.floor(hi / step + 1e-9) - first + 1)]
    return [0.0 if abs(t) < step * 1e-9 else t for t in ticks]


def _tick_label(v: float, ticks: Sequence[float]) -> str:
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) + (1 if round(step / 10 ** math.floor(
        math.log10(step) + 1e-9), 6) == 2.5 else 0)
    return f"{v:.{decimals}f}"


def histogram_counts(xs: Sequence[float], bins: int) -> tuple[float, float, list[int]]:
    """``(lo, hi, counts)``: ``bins`` equal-width bins over [min, max] (numpy's ``histogram``: half-open, the
    last one closed); one distinct value gets the range value +- 0.5."""
    lo, hi = min(xs), max(xs)
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    width = (hi - lo) / bins
    edges = [lo + k * width for k in range(bins)] + [hi]
    counts = [0] * bins
    for x in xs:
        i = min(int((x - lo) / width), bins - 1)
        # the computed index can be one off at an edge in floating point: settle it against the edges
        while i > 0 and x < edges[i]:
            i -= 1
        while i < bins - 1 and x >= edges[i + 1]:
            i += 1
        counts[i] += 1
    return lo, hi, counts


def histogram_svg(values: Sequence[float], *, title: str = "", bins: int = 12, width: int = 260,
                  height: int = 130) -> str:
    """A bar histogram with axes (value, count) as inline SVG; ``class='histogram'``.

    Drawn directly as SVG elements (bars, spines, tick marks, tick labels as ``<text>``, a "count" label), not
    with matplotlib: a phase deck draws two of these every step, and matplotlib's layout took ~0.12 s each
    (a local Flyte step's largest overhead). Bins as numpy's ``histogram``: equal widths over [min, max], the
    last one closed; one distinct value gets the range value +- 0.5."""
    xs = [float(v) for v in values if math.isfinite(float(v))]
    if not xs:
        return "<svg class=\"histogram\" width=\"0\" height=\"0\"></svg>"
    lo, hi, counts = histogram_counts(xs, bins)
    yticks = nice_ticks(0.0, max(max(counts), 1), 4, integer=True)
    top = max(max(counts), yticks[-1])
    xticks = nice_ticks(lo, hi, 5)
    left, right, bottom = 36.0, 18.0, 20.0
    ptop = 16.0 if title else 6.0
    pw, ph = width - left - right, height - ptop - bottom

    def sx(v: float) -> float:
        return left + (v - lo) / (hi - lo) * pw

    def sy(c: float) -> float:
        return ptop + ph - c / top * ph

    out = [(f'<svg class="histogram" data-n="{len(xs)}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="8">')]
    if title:
        out.append(f'<text x="{left + pw / 2:.1f}" y="10" text-anchor="middle" font-size="9">{html.escape(title)}'
                   "</text>")
    bw = pw / bins
    for i, c in enumerate(counts):
        if c:
            out.append(f'<rect x="{left + i * bw:.2f}" y="{sy(c):.2f}" width="{bw:.2f}" height="{ptop + ph - sy(c):.2f}" '
                       'fill="#3a6fc4" stroke="white" stroke-width="0.5"/>')
    out.append(f'<path d="M{left} {ptop}V{ptop + ph}H{left + pw}" fill="none" stroke="black" stroke-width="0.8"/>')
    for t in yticks:
        y = sy(t)
        out.append(f'<path d="M{left - 3} {y:.2f}H{left}" stroke="black" stroke-width="0.8"/>'
                   f'<text x="{left - 5}" y="{y + 3:.2f}" text-anchor="end">{int(t)}</text>')
    for t in xticks:
        x = sx(t)
        out.append(f'<path d="M{x:.2f} {ptop + ph}V{ptop + ph + 3}" stroke="black" stroke-width="0.8"/>'
                   f'<text x="{x:.2f}" y="{ptop + ph + 12:.2f}" text-anchor="middle">{_tick_label(t, xticks)}</text>')
    out.append(f'<text x="9" y="{ptop + ph / 2:.1f}" text-anchor="middle" transform="rotate(-90 9 {ptop + ph / 2:.1f})">'
               "count</text></svg>")
    return "".join(out)