"""Report charts checked in matplotlib's SVG structure: the axis groups (``matplotlib.axis_1`` = x,
``matplotlib.axis_2`` = y) with their ticks, the tick label texts, the axis labels, the title, the legend, and the
data lines (``series_<i>``, ``ema``) with a vertex and a marker per point. No font metrics are involved: the SVG
keeps text as ``<text>``; the one layout check (labels inside the figure) uses the fonts matplotlib ships."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from unirl_core.report.charts import chart_style, downsample, ema, histogram_svg, line_chart_figure, line_chart_svg

REPO = Path(__file__).resolve().parents[3]
SVG = "{http://www.w3.org/2000/svg}"


def _root(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def _group(root: ET.Element, gid: str) -> ET.Element:
    found = [g for g in root.iter(f"{SVG}g") if g.get("id") == gid]
    assert len(found) == 1, f"{len(found)} groups with id {gid!r}"
    return found[0]


def _has(root: ET.Element, gid: str) -> bool:
    return any(g.get("id") == gid for g in root.iter(f"{SVG}g"))


def _texts(el: ET.Element) -> list[str]:
    return [t.text for t in el.iter(f"{SVG}text")]


def _axis(root: ET.Element, axis: str) -> ET.Element:
    return _group(root, f"matplotlib.axis_{1 if axis == 'x' else 2}")


def _ticks(root: ET.Element, axis: str) -> dict[str, float]:
    """Tick label text -> the tick mark's position along the axis (SVG user units)."""
    out = {}
    for tick in _axis(root, axis):
        if tick.get("id", "").startswith(f"{axis}tick_"):
            (label,) = _texts(tick)
            mark = next(tick.iter(f"{SVG}use"))
            out[label] = float(mark.get(axis))
    return out


def _axis_texts(root: ET.Element, axis: str) -> list[str]:
    """The axis label and offset text: the texts of the axis group outside its ticks."""
    return [t for g in _axis(root, axis) if g.get("id", "").startswith("text_") for t in _texts(g)]


def _vertices(root: ET.Element, gid: str) -> list[tuple[float, float]]:
    path = next(_group(root, gid).iter(f"{SVG}path"))
    return [(float(x), float(y)) for x, y in re.findall(r"[ML] (-?[\d.]+) (-?[\d.]+)", path.get("d"))]


def _markers(root: ET.Element, gid: str) -> list[tuple[float, float]]:
    return [(float(u.get("x")), float(u.get("y"))) for u in _group(root, gid).iter(f"{SVG}use")]


def _number(label: str) -> float:
    return float(label.replace("\u2212", "-"))


def _data_to_svg(ticks: dict[str, float], value: float) -> float:
    """Where ``value`` lies on an axis, by linear interpolation between its first and last tick."""
    (a, pa), (b, pb) = ((_number(k), v) for k, v in list(ticks.items())[::len(ticks) - 1])
    return pa + (value - a) * (pb - pa) / (b - a)


def test_line_chart_axes_ticks_labels_points_and_ema():
    points = [(s, 0.1 * s) for s in range(1, 11)]
    svg = line_chart_svg(points, title="reward/mean", smooth=0.6)
    assert svg.startswith('<svg class="curve" data-metric="reward/mean"') and "<?xml" not in svg
    root = _root(svg)
    xt, yt = _ticks(root, "x"), _ticks(root, "y")
    assert list(xt) == ["2", "4", "6", "8", "10"]
    assert list(yt) == ["0.2", "0.4", "0.6", "0.8", "1.0"]
    assert _axis_texts(root, "x") == ["step"] and _axis_texts(root, "y") == []
    assert "reward/mean" in [t for g in _group(root, "axes_1") if g.get("id", "").startswith("text_")
                             for t in _texts(g)]  # the title
    assert _texts(_group(root, "legend_1")) == ["EMA 0.6"]
    # one vertex and one marker per point, where the ticks say the point is
    raw = _vertices(root, "series_0")
    assert _markers(root, "series_0") == raw and len(raw) == 10
    for (s, v), (x, y) in zip(points, raw, strict=True):
        assert x == pytest.approx(_data_to_svg(xt, s), abs=1e-3) and y == pytest.approx(_data_to_svg(yt, v), abs=1e-3)
    smooth = ema([v for _, v in points], 0.6)
    assert [y for _, y in _vertices(root, "ema")] == pytest.approx([_data_to_svg(yt, v) for v in smooth], abs=1e-3)


def test_line_chart_options_and_edge_cases():
    plain = _root(line_chart_svg([(1, 0.0), (2, 1.0), (3, 2.0)], title="x", smooth=None, ylabel="nats"))
    assert not _has(plain, "ema") and not _has(plain, "legend_1") and _axis_texts(plain, "y") == ["nats"]
    assert line_chart_svg([(1, float("nan"))], title="x") == ""
    one = _root(line_chart_svg([(5, 1.0)], title="single"))  # one step: a visible range around it
    assert list(_ticks(one, "x")) == ["4", "5", "6"] and len(_markers(one, "series_0")) == 1
    flat = _ticks(_root(line_chart_svg([(1, 1.0), (2, 1.0 + 1e-12)], title="flat")), "y")
    assert [_number(t) for t in flat] == pytest.approx([0.95, 0.975, 1.0, 1.025, 1.05])  # not a window of ulps


def test_series_share_the_axes_with_the_legend_below():
    ratio = [(s, 1.0 + 0.01 * s) for s in range(1, 6)]
    svg = line_chart_svg(ratio, title="train/ratio_mean", label="mean",
                         series={"train/ratio_min": [(s, 0.9) for s in range(1, 6)],
                                 "train/ratio_max": [(s, 1.2) for s in range(1, 6)]})
    root = _root(svg)
    assert [len(_markers(root, f"series_{i}")) for i in range(3)] == [5, 5, 5]
    legend = _group(root, "legend_1")
    assert _texts(legend) == ["mean", "train/ratio_min", "train/ratio_max", "EMA 0.6"]
    assert legend in list(_group(root, "figure_1"))  # the figure's legend, not one inside the axes
    step_y = float(next(_group(root, "matplotlib.axis_1").iter(f"{SVG}text")).get("y"))
    assert all(float(t.get("y")) > step_y for t in legend.iter(f"{SVG}text"))  # below the x axis


def test_long_runs_keep_charts_small():
    pts = [(s, (s % 7) / 7) for s in range(20_000)]
    assert len(downsample(pts)) == 500 and downsample(pts)[-1] == pts[-1]
    svg = line_chart_svg(pts, title="long")
    root = _root(svg)
    assert len(_vertices(root, "series_0")) == 500 and len(_vertices(root, "ema")) == 500
    assert _markers(root, "series_0") == [] and len(svg) < 60_000
    assert ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # bias-corrected: no pull towards 0


def test_charts_are_deterministic():
    pts = [(s, np.sin(s)) for s in range(1, 30)]
    assert line_chart_svg(pts, title="a") == line_chart_svg(pts, title="a")
    assert histogram_svg([0.1, 0.2, 0.2]) == histogram_svg([0.1, 0.2, 0.2])


@pytest.mark.parametrize("values,yticks,offset", [
    ([1.2e-7, 3.4e-7, 2.2e-7], ["1.5", "2.0", "2.5", "3.0", "3.5"], ["1e\u22127"]),
    ([-12345.5, 20000.25, 1.0], ["\u22128000", "0", "8000", "16000"], []),
    ([0.5, 0.75, 0.6], ["0.54", "0.60", "0.66", "0.72"], []),
])
def test_y_tick_labels_of_any_range_fit_inside_the_figure(values, yticks, offset):
    """Small and large ranges: the y tick labels are the expected numbers (a power of ten goes to the offset text),
    and every text of the figure lies inside it, as laid out with the fonts matplotlib ships (a fixed margin cut
    long labels off)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    pts = list(enumerate(values, 1))
    root = _root(line_chart_svg(pts, title="train/logp_absdiff_mean", ylabel="nats"))
    assert list(_ticks(root, "y")) == yticks
    assert _axis_texts(root, "y") == ["nats", *offset]
    with chart_style("t"):
        fig = line_chart_figure(pts, title="train/logp_absdiff_mean", ylabel="nats")
        renderer = FigureCanvasAgg(fig).get_renderer()
        fig.draw(renderer)
        drawn = fig.get_tightbbox(renderer)  # inches: every drawn artist, tick labels and axis labels included
        (ax,) = fig.axes
        left = min(t.get_window_extent(renderer).x0 for t in ax.get_yticklabels() if t.get_text() in yticks)
    assert drawn.x0 >= 0 and drawn.y0 >= 0 and drawn.x1 <= fig.get_figwidth() and drawn.y1 <= fig.get_figheight()
    assert left > ax.yaxis.label.get_window_extent(renderer).x1  # the labels clear the rotated axis label


def _bar_heights(root: ET.Element, bins: int) -> list[float]:
    return [max(y for _, y in v) - min(y for _, y in v) for v in (_vertices(root, f"bar_{i}") for i in range(bins))]


@pytest.mark.parametrize("seed,bins", [(0, 12), (1, 7), (2, 3)])
def test_histogram_bars_are_numpy_counts(seed, bins):
    rng = np.random.default_rng(seed)
    xs = np.concatenate([rng.normal(size=200), np.linspace(-1, 1, 13), [0.1, 0.1, 0.3]]).tolist()
    root = _root(histogram_svg(xs, bins=bins))
    counts, _ = np.histogram(xs, bins=bins)
    heights = _bar_heights(root, bins)
    assert not _has(root, f"bar_{bins}")
    assert [h / max(heights) for h in heights] == pytest.approx((counts / counts.max()).tolist(), abs=1e-5)


def test_histogram_has_axes():
    svg = histogram_svg([0.0, 0.5, 1.0, 1.0])
    assert svg.startswith('<svg class="histogram" data-n="4"')
    root = _root(svg)
    assert list(_ticks(root, "x")) == ["0.00", "0.25", "0.50", "0.75", "1.00"]
    assert list(_ticks(root, "y")) == ["0", "1", "2"] and _axis_texts(root, "y") == ["count"]
    assert sum(h > 0 for h in _bar_heights(root, 12)) == 3  # a bar per non-empty bin
    small = _root(histogram_svg([-0.0071, -0.0068, -0.0065, -0.0064]))  # small ranges keep their ticks
    assert list(_ticks(small, "x")) == ["\u22120.0070", "\u22120.0068", "\u22120.0066", "\u22120.0064"]
    one = _root(histogram_svg([2.0, 2.0], bins=4))  # one value: its +- 0.5 range
    assert list(_ticks(one, "x")) == ["1.50", "1.75", "2.00", "2.25", "2.50"]
    assert [h > 0 for h in _bar_heights(one, 4)] == [False, False, True, False]
    assert histogram_svg([float("nan")]) == '<svg class="histogram" width="0" height="0"></svg>'


def test_eval_charts_hold_every_evaluated_version_the_start_included():
    """The eval section: the starting policy (step 0, an eval record only) and each evaluated step on one reward
    chart with the components beside it; no chart for the reward's spread or the bookkeeping."""
    from unirl_core.report.eval_report import EvalRecord
    from unirl_core.report.run_report import StepRecord, _eval_charts

    evald = {"eval/reward/mean": 0.4, "eval/reward/acc/mean": 0.5, "eval/reward/std": 0.1, "eval/seconds": 2.0,
             "eval/samples": 8.0, "eval/response_tokens_mean": 3.0}
    records = [StepRecord(step=s, time=0.0, metrics={"reward/mean": 0.1 * s, **(evald if s == 4 else {})})
               for s in range(1, 5)]
    start = EvalRecord(step=0, metrics={**evald, "eval/reward/mean": 0.2, "eval/reward/acc/mean": 0.3})
    charts = _eval_charts(records, [start, EvalRecord(step=4, metrics=evald)])
    titles = [re.search(r'data-metric="([^"]+)"', c).group(1) for c in charts]
    assert titles == ["eval/reward/mean", "eval/response_tokens_mean"]
    reward = _root(charts[0])
    xt = _ticks(reward, "x")
    assert {"0", "4"} <= set(xt)
    for gid, values in (("series_0", (0.2, 0.4)), ("series_1", (0.3, 0.5))):  # the mean, the acc component
        marks = _markers(reward, gid)
        assert [x for x, _ in marks] == pytest.approx([_data_to_svg(xt, 0), _data_to_svg(xt, 4)], abs=1e-3)
        assert [y for _, y in marks] == pytest.approx([_data_to_svg(_ticks(reward, "y"), v) for v in values],
                                                      abs=1e-3)
    assert _texts(_group(reward, "legend_1")) == ["eval/reward/mean", "eval/reward/acc/mean"]


@pytest.mark.slow
def test_importing_the_report_does_not_import_matplotlib():
    code = ("import sys; import unirl_core.report.run_report, unirl_core.report.phase_html; "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert out.stdout.strip() == "False"
