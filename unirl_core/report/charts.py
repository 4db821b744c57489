"""Curves and histograms of the run report and the phase decks, written as inline SVG (offline, no JavaScript).

Every chart has both axes with ticks and tick labels (``<text>`` elements, so the page stays searchable and
small), a title, a step axis label, the raw points and, optionally, an exponential moving average (EMA) line.
The SVG elements are written directly (no plotting library): the charts are pure functions of their points,
cost ~1 ms each instead of matplotlib's ~0.1-0.3 s of layout, and are safe in any thread or process.
"""

from __future__ import annotations

import html
import math
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


COLORS = ("#3a6fc4", "#d9822b", "#3f9b5c", "#9b59b6", "#c0392b")


def _fmt(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".")


def _polyline(pts: Sequence[tuple[float, float]], color: str, width: float, opacity: float) -> str:
    return (f'<polyline fill="none" stroke="{color}" stroke-width="{width}" stroke-opacity="{opacity}" '
            f'stroke-linejoin="round" points="{" ".join(f"{_fmt(x)},{_fmt(y)}" for x, y in pts)}"/>')


def line_chart_svg(points: Points, *, title: str, smooth: float | None = 0.6,
                   series: dict[str, Points] | None = None, ylabel: str = "", label: str | None = None,
                   width: int = 380, height: int = 220) -> str:
    """One chart as inline SVG: ``points`` (``(step, value)``) against the step, with axes, ticks and labels.

    ``smooth``: EMA smoothing drawn over the raw curve when there are at least 3 points (None: off).
    ``series``: further named curves on the same axes (e.g. ``ratio_min``/``ratio_max`` next to the mean);
    ``label``: the legend name of ``points`` when there are series (default ``title``).
    Returns ``""`` when no point is finite. The root element carries ``class='curve'`` and ``data-metric``.
    Drawn as SVG elements directly (grid, spines, ticks, ``<text>`` labels, polylines, markers, legend): the
    run report draws ~10 of these per render, which took ~0.12-0.28 s each through matplotlib's layout."""
    curves = {title: finite(points), **{k: finite(v) for k, v in (series or {}).items()}}
    curves = {k: sorted(v) for k, v in curves.items() if v}
    if not curves.get(title):
        return ""
    main = curves[title]
    drawn = {k: downsample(v) for k, v in curves.items()}
    smoothed = (downsample(list(zip([p[0] for p in main], ema([p[1] for p in main], smooth), strict=True)))
                if smooth is not None and len(main) >= 3 else [])
    allpts = [p for v in drawn.values() for p in v] + smoothed
    x0, x1 = min(p[0] for p in allpts), max(p[0] for p in allpts)
    if x0 == x1:  # one step: a visible range around it
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = min(p[1] for p in allpts), max(p[1] for p in allpts)
    flat = y1 - y0 <= 1e-9 * max(1.0, abs(y0), abs(y1))  # equal up to rounding: a visible range around it
    pad = max(abs(y0) * 0.05, 0.05) if flat else (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
    names = [label or title, *list(curves)[1:]] if series else []
    legend = [(n, COLORS[i % len(COLORS)], 1.2) for i, n in enumerate(names)]
    if smoothed:
        legend.append((f"EMA {smooth:g}", COLORS[0], 2.0))
    rows = (len(legend) + 2) // 3 if series else 0
    full_h = height + 16 * rows + (6 if rows else 0)
    xt = nice_ticks(x0, x1, 6, integer=True)
    yt = nice_ticks(y0, y1, 5)
    ylabels = [_tick_label(t, yt) for t in yt]
    # room for the longest y tick label (~6.5 px a character at font-size 11) and the rotated axis label
    left = max(60.0, 14.0 + 6.5 * max(map(len, ylabels)) + (14.0 if ylabel else 0.0))
    right, top, bottom = 14.0, 26.0, 42.0
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    out = [(f'<svg class="curve" data-metric="{html.escape(title)}" style="margin:4px;border:1px solid #ddd" '
            f'xmlns="http://www.w3.org/2000/svg" width="{width * 0.75:g}pt" height="{full_h * 0.75:g}pt" '
            f'viewBox="0 0 {width} {full_h}" font-family="sans-serif" font-size="11">'),
           f'<rect width="{width}" height="{full_h}" fill="white"/>',
           f'<text x="{left + pw / 2:.1f}" y="17" text-anchor="middle" font-size="13">{html.escape(title)}</text>']
    for t in xt:
        x = sx(t)
        out.append(f'<path d="M{x:.1f} {top}V{top + ph}" stroke="#e4e4e4" stroke-width="0.6"/>'
                   f'<path d="M{x:.1f} {top + ph}V{top + ph + 5}" stroke="black" stroke-width="1.07"/>'
                   f'<text x="{x:.1f}" y="{top + ph + 17:.1f}" text-anchor="middle">{int(t)}</text>')
    for t, label in zip(yt, ylabels):
        y = sy(t)
        out.append(f'<path d="M{left:g} {y:.1f}H{left + pw:g}" stroke="#e4e4e4" stroke-width="0.6"/>'
                   f'<path d="M{left - 5:g} {y:.1f}H{left:g}" stroke="black" stroke-width="1.07"/>'
                   f'<text x="{left - 7:g}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    out.append(f'<rect x="{left:g}" y="{top}" width="{pw:g}" height="{ph}" fill="none" stroke="black" '
               'stroke-width="1.07"/>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{top + ph + 33:.1f}" text-anchor="middle" font-size="12.5">step</text>')
    if ylabel:
        out.append(f'<text x="12" y="{top + ph / 2:.1f}" text-anchor="middle" font-size="12" '
                   f'transform="rotate(-90 12 {top + ph / 2:.1f})">{html.escape(ylabel)}</text>')
    for i, (name, pts) in enumerate(drawn.items()):
        color = COLORS[i % len(COLORS)]
        faded = bool(smoothed) and name == title
        xy = [(sx(x), sy(y)) for x, y in pts]
        out.append(_polyline(xy, color, 1.2, 0.35 if faded else 0.95))
        if len(curves[name]) <= MARKER_POINTS:
            out.extend(f'<circle cx="{_fmt(x)}" cy="{_fmt(y)}" r="1.8" fill="{color}" '
                       f'fill-opacity="{0.35 if faded else 0.95}"/>' for x, y in xy)
    if smoothed:
        out.append(_polyline([(sx(x), sy(y)) for x, y in smoothed], COLORS[0], 2.0, 1.0))
    if series:  # several curves: the legend goes below the axes, never over the data
        for k, (name, color, lw) in enumerate(legend):
            lx, ly = 12 + (k % 3) * (width - 24) / 3, height + 10 + 16 * (k // 3)
            out.append(f'<path d="M{lx:.1f} {ly - 3}h14" stroke="{color}" stroke-width="{lw}"/>'
                       f'<text x="{lx + 18:.1f}" y="{ly:.1f}" font-size="8.5">{html.escape(name)}</text>')
    elif legend:  # the EMA alone: a small box in the corner that covers the fewest points
        name, color, lw = legend[0]
        bw, bh = 28 + 5.6 * len(name), 15.0
        xy = [(sx(x), sy(y)) for v in [*drawn.values(), smoothed] for x, y in v]
        corners = [(left + pw - 4 - bw, top + 4), (left + 4, top + 4), (left + pw - 4 - bw, top + ph - 4 - bh),
                   (left + 4, top + ph - 4 - bh)]
        bx, by = min(corners, key=lambda c: sum(c[0] <= x <= c[0] + bw and c[1] <= y <= c[1] + bh for x, y in xy))
        out.append(f'<rect x="{bx:.1f}" y="{by:.1f}" width="{bw:.1f}" height="{bh}" fill="white" fill-opacity="0.85"/>'
                   f'<path d="M{bx + 4:.1f} {by + 7.5:.1f}h14" stroke="{color}" stroke-width="{lw}"/>'
                   f'<text x="{bx + 22:.1f}" y="{by + 11:.1f}" font-size="8.5">{html.escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


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
    step = ticks[1] - ticks[0] if len(ticks) > 1 and ticks[1] > ticks[0] else 1.0
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
    left, right, bottom = 38.0, 20.0, 22.0
    ptop = 18.0 if title else 7.0
    pw, ph = width - left - right, height - ptop - bottom

    def sx(v: float) -> float:
        return left + (v - lo) / (hi - lo) * pw

    def sy(c: float) -> float:
        return ptop + ph - c / top * ph

    out = [(f'<svg class="histogram" data-n="{len(xs)}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="9.3">')]
    if title:
        out.append(f'<text x="{left + pw / 2:.1f}" y="12" text-anchor="middle" font-size="10.7">{html.escape(title)}'
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
                   f'<text x="{x:.2f}" y="{ptop + ph + 13:.2f}" text-anchor="middle">{_tick_label(t, xticks)}</text>')
    out.append(f'<text x="9" y="{ptop + ph / 2:.1f}" text-anchor="middle" transform="rotate(-90 9 {ptop + ph / 2:.1f})">'
               "count</text></svg>")
    return "".join(out)