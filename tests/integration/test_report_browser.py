"""The run report and the phase decks of real (tiny, local) runs opened in headless Chromium.

Checks hold whatever fonts the machine has: chart content is read from the SVG structure that matplotlib writes
(``matplotlib.axis_1``/``_2`` groups, ``xtick_N``/``ytick_N`` with their ``<text>``, the axis label), and layout
from the browser's DOM geometry (``getBoundingClientRect`` of every chart and of each of its texts, measured by a
script the test appends to a copy of the page): a chart is visible, as large as it says, inside the viewport,
and none of its texts sticks out of it (an inline ``<svg>`` clips what does). No pixel is counted. Screenshots
of the report and of one chart alone are still taken for a person to look at: they are written to
``<pytest basetemp>/screenshots0/`` (``pytest --basetemp DIR`` to keep them at a known place).

Every deck page (the same HTML the tasks' Flyte decks show) must keep its content: the sample grid or the
conversation table, the reward histograms, the policy statistics and the timings.

Needs Debian's ``chromium`` (``apt-get install -y chromium``). Run on 2026-12-06 both with ``fonts-liberation``
installed and with it removed (``apt-get remove -y fonts-liberation``; DejaVu fonts present): all tests passed
both times."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from PIL import Image

from tests.flyte.conftest import tiny_overrides
from workflows.grpo import grpo

pytestmark = pytest.mark.integration

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--force-device-scale-factor=1"]
VIEWPORT = (1280, 1600)
SVG = "{http://www.w3.org/2000/svg}"
NUMBER = re.compile(r"^[\u2212\-]?\d+(\.\d+)?$")
GEOMETRY = """<script>
addEventListener('load', () => {
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const charts = [...document.querySelectorAll('svg.curve, svg.histogram')].map(svg => ({
    metric: svg.dataset.metric || svg.getAttribute('class'), box: box(svg),
    width: svg.width.baseVal.value, height: svg.height.baseVal.value,
    shown: getComputedStyle(svg).display !== 'none' && getComputedStyle(svg).visibility === 'visible',
    texts: [...svg.querySelectorAll('text')].map(t => [t.textContent, box(t)])}));
  const images = [...document.images].map(i => i.complete && i.naturalWidth > 0);
  const out = {viewport: [innerWidth, innerHeight], scroll_width: document.documentElement.scrollWidth, charts, images};
  const pre = document.createElement('pre');
  pre.id = 'geometry';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise RuntimeError("headless Chromium is required: apt-get install -y chromium")
    return exe


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{uuid.uuid4().hex[:6]}"
    return subprocess.run([_chromium(), *FLAGS, f"--user-data-dir={profile}",
                           f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", *args], capture_output=True, timeout=180)


def _dom(page: Path, tmp: Path) -> str:
    proc = _run(["--virtual-time-budget=5000", "--dump-dom", page.as_uri()], tmp)
    dom = proc.stdout.decode()
    assert proc.returncode == 0 and "</html>" in dom, proc.stderr.decode()[-2000:]
    return dom


def _geometry(page: Path, tmp: Path) -> dict:
    """The page's layout as the browser computed it: a copy of ``page`` (next to it, so relative links resolve)
    with ``GEOMETRY`` appended, dumped after load."""
    probe = page.with_name(f"{page.stem}-geometry-{uuid.uuid4().hex[:6]}.html")
    probe.write_text(page.read_text().replace("</body>", f"{GEOMETRY}</body>"))
    m = re.search(r'<pre id="geometry">(.*?)</pre>', _dom(probe, tmp), flags=re.S)
    assert m, "the geometry script did not run"
    return json.loads(m.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def _screenshot(page: Path, tmp: Path, shots: Path) -> Path:
    """A screenshot of ``page`` in the viewport, kept in ``shots`` for a person to look at."""
    shot = shots / f"{page.parent.name}-{page.stem}.png"
    proc = _run([f"--screenshot={shot}", page.as_uri()], tmp)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr.decode()[-2000:]
    with Image.open(shot) as im:
        assert im.size == VIEWPORT
    return shot


def _svgs(dom: str, css_class: str) -> list[ET.Element]:
    return [ET.fromstring(s) for s in re.findall(rf'<svg class="{css_class}".*?</svg>', dom, flags=re.S)]


def _tick_labels(svg: ET.Element, axis: str) -> list[str]:
    group = next(g for g in svg.iter(f"{SVG}g") if g.get("id") == f"matplotlib.axis_{1 if axis == 'x' else 2}")
    return [t.text for tick in group if tick.get("id", "").startswith(f"{axis}tick_") for t in tick.iter(f"{SVG}text")]


def _axis_label(svg: ET.Element, axis: str) -> list[str]:
    group = next(g for g in svg.iter(f"{SVG}g") if g.get("id") == f"matplotlib.axis_{1 if axis == 'x' else 2}")
    return [t.text for g in group if g.get("id", "").startswith("text_") for t in g.iter(f"{SVG}text")]


def _inside(inner: list[float], outer: list[float]) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


def _check_chart_layout(chart: dict) -> None:
    """Visible, drawn at its own size (CSS px of its pt size), and every text inside its box."""
    left, top, right, bottom = chart["box"]
    assert chart["shown"] and chart["width"] > 0 and chart["height"] > 0, chart["metric"]
    # the box includes a 1 px border on each side for the report's curves
    assert right - left == pytest.approx(chart["width"] + (2 if chart["metric"] != "histogram" else 0), abs=1.0)
    assert len(chart["texts"]) >= 5, chart["metric"]  # tick labels of both axes and an axis label at least
    for text, box in chart["texts"]:
        assert _inside(box, chart["box"]), f"{chart['metric']}: text {text!r} at {box} outside {chart['box']}"


def _run_report(tmp_path_factory, recipe: str, steps: int) -> Path:
    root = tmp_path_factory.mktemp("runs")
    name = f"browser-{uuid.uuid4().hex[:8]}"
    grpo(recipe=recipe, overrides=tiny_overrides(recipe, str(root), name, steps=steps))
    return root / name / "report" / "index.html"


@pytest.fixture(scope="module")
def report_index(tmp_path_factory) -> Path:
    return _run_report(tmp_path_factory, "tiny-flow-grpo", 2)


@pytest.fixture(scope="module")
def lm_report_index(tmp_path_factory) -> Path:
    return _run_report(tmp_path_factory, "tiny-grpo", 3)


def test_dom_has_step_rows_charts_with_axes_and_thumbnails(report_index, tmp_path):
    dom = _dom(report_index, tmp_path)
    assert dom.count('class="step-row"') == 2
    charts = {c.get("data-metric"): c for c in _svgs(dom, "curve")}
    for wanted in ("reward/mean", "reward/jpeg_compressibility/mean", "train/ratio_mean", "train/clip_frac",
                   "train/kl", "train/logp_absdiff_mean", "train/loss", "time per phase"):
        assert wanted in charts, list(charts)
    for metric, svg in charts.items():
        # both axes with tick labels: the x axis has the steps 1 and 2, the y axis at least two numbers
        assert {"1", "2"} <= set(_tick_labels(svg, "x")), metric
        assert len([t for t in _tick_labels(svg, "y") if NUMBER.match(t)]) >= 2, metric
        assert _axis_label(svg, "x") == ["step"], metric
    # the sample strips of both steps (a small flat-colour PNG goes in as it is, any other image as a JPEG)
    assert len(re.findall(r'src="data:image/(?:png|jpeg);base64,', dom)) >= 8
    assert 'class="strip-note"' in dom and "the first, the last" in dom
    assert "step-00000002/rollout.html" in dom and '"name": "browser-' in dom  # deck pages, the config


def test_report_layout_keeps_every_chart_and_its_texts_inside(report_index, tmp_path, shots):
    """In a 1280 px wide window: no chart is hidden or pushes the page wider than the window, each is drawn at its
    own size with every text inside its box, and every thumbnail decoded. The screenshot is for a person."""
    _screenshot(report_index, tmp_path, shots)
    geo = _geometry(report_index, tmp_path)
    width = geo["viewport"][0]
    assert geo["scroll_width"] <= width and len(geo["charts"]) >= 8
    for chart in geo["charts"]:
        _check_chart_layout(chart)
        assert 0 <= chart["box"][0] and chart["box"][2] <= width, chart["metric"]
    assert len(geo["images"]) >= 8 and all(geo["images"])


def test_a_chart_alone_lies_inside_the_viewport(report_index, tmp_path, shots):
    """Two charts alone on a page, the reward (long y tick labels: a tiny run's rewards are ~ -0.0069) and the loss
    (~1e-9: an offset text above the y axis): inside the viewport, every text inside the chart's box."""
    dom = _dom(report_index, tmp_path)
    for metric in ("reward/mean", "train/loss"):
        svg = re.search(rf'<svg class="curve" data-metric="{re.escape(metric)}".*?</svg>', dom, flags=re.S).group(0)
        page = tmp_path / f"chart-{metric.replace('/', '_')}.html"
        page.write_text(f"<!doctype html><html><body style='margin:0;background:#fff'>{svg}</body></html>")
        _screenshot(page, tmp_path, shots)
        (chart,) = _geometry(page, tmp_path)["charts"]
        _check_chart_layout(chart)
        assert _inside(chart["box"], [0, 0, *VIEWPORT]), chart["box"]


def _table(dom: str, css_class: str) -> str:
    m = re.search(rf'<table class="{css_class}".*?</table>', dom, flags=re.S)
    assert m, f"no table of class {css_class}"
    return m.group(0)


def test_flow_decks_render_grid_histogram_statistics_and_timings(report_index, tmp_path, shots):
    step = report_index.parent / "step-00000002"
    rollout = _dom(step / "rollout.html", tmp_path)
    assert len(re.findall(r'src="data:image/(?:png|jpeg);base64,', _table(rollout, "sample-grid"))) == 8
    assert "time/rollout" in _table(rollout, "timings") or "rollout/seconds" in _table(rollout, "timings")
    reward = _dom(step / "reward.html", tmp_path)
    assert "jpeg_compressibility" in _table(reward, "reward-components")
    hists = _svgs(reward, "histogram")
    assert len(hists) >= 2  # component and total, with axes
    for svg in hists:
        assert len(_tick_labels(svg, "x")) >= 2 and len(_tick_labels(svg, "y")) >= 2
        assert _axis_label(svg, "y") == ["count"]
        assert any(g.get("id", "").startswith("bar_") for g in svg.iter(f"{SVG}g"))
    _screenshot(step / "reward.html", tmp_path, shots)
    for chart in _geometry(step / "reward.html", tmp_path)["charts"]:
        _check_chart_layout(chart)
    train = _dom(step / "train.html", tmp_path)
    stats = _table(train, "policy-stats")
    for key in ("train/ratio_mean", "train/clip_frac", "train/kl", "train/logp_absdiff_mean"):
        assert f">{key}<" in stats, key
    assert ">time/train<" in _table(train, "timings")
    assert ">train/loss<" in _table(train, "metrics")
    assert "<tr>" in _dom(step / "advantage.html", tmp_path) and "sha256" in _dom(step / "publish.html", tmp_path)


def test_lm_decks_show_the_conversation_table_without_replacement_characters(lm_report_index, tmp_path):
    step = lm_report_index.parent / "step-00000003"
    rollout = _dom(step / "rollout.html", tmp_path)
    table = _table(rollout, "conversations")
    assert table.count("<tr>") == 1 + 8 and "+" in table  # header + 2 prompts x 4 samples, arithmetic prompts
    assert "\ufffd" not in table
    assert "\ufffd" not in _dom(lm_report_index, tmp_path)
    reward = _dom(step / "reward.html", tmp_path)
    assert "toy_arithmetic" in reward and _svgs(reward, "histogram")
    train = _dom(step / "train.html", tmp_path)
    assert ">train/ratio_mean<" in _table(train, "policy-stats") and ">time/train<" in _table(train, "timings")
