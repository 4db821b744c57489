"""The run report and the phase decks of real (tiny, local) runs opened in headless Chromium.

The index's charts must keep their axes (tick labels in the DOM and ink in the axis region of a screenshot),
and every deck page (the same HTML the tasks' Flyte decks show) must keep its content: the sample grid or the
conversation table, the reward histogram, the policy statistics and the timings.

Needs Debian's ``chromium`` (``apt-get install -y chromium``)."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from PIL import Image

from tests.flyte.conftest import tiny_overrides
from workflows.grpo import grpo

pytestmark = pytest.mark.integration

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--force-device-scale-factor=1"]
NUMBER = re.compile(r"^[\u2212\-]?\d+(\.\d+)?(e[\u2212\-+]?\d+)?$")


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise RuntimeError("headless Chromium is required: apt-get install -y chromium")
    return exe


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{uuid.uuid4().hex[:6]}"
    return subprocess.run([_chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          timeout=180)


def _dom(page: Path, tmp: Path) -> str:
    proc = _run(["--dump-dom", page.as_uri()], tmp)
    dom = proc.stdout.decode()
    assert proc.returncode == 0 and "</html>" in dom, proc.stderr.decode()[-2000:]
    return dom


def _screenshot(page: Path, tmp: Path, size: tuple[int, int]) -> Image.Image:
    shot = tmp / f"{page.stem}-{uuid.uuid4().hex[:6]}.png"
    proc = _run([f"--screenshot={shot}", f"--window-size={size[0]},{size[1]}", page.as_uri()], tmp)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr.decode()[-2000:]
    with Image.open(io.BytesIO(shot.read_bytes())) as im:
        return im.convert("RGB")


def _svgs(dom: str, css_class: str) -> list[str]:
    return re.findall(rf'<svg class="{css_class}".*?</svg>', dom, flags=re.S)


def _tick_numbers(svg: str) -> list[str]:
    return [t.strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg) if NUMBER.match(t.strip())]


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
    charts = _svgs(dom, "curve")
    metrics = [re.search(r'data-metric="([^"]+)"', c).group(1) for c in charts]
    for wanted in ("reward/mean", "reward/jpeg_compressibility/mean", "train/ratio_mean", "train/clip_frac",
                   "train/kl", "train/logp_absdiff_mean", "train/loss", "time per phase"):
        assert wanted in metrics, metrics
    for metric, svg in zip(metrics, charts):
        # tick labels on both axes: the x axis has the steps 1 and 2, the y axis at least two values
        ticks = _tick_numbers(svg)
        assert {"1", "2"} <= set(ticks) and len(ticks) >= 4, (metric, ticks)
        assert ">step<" in svg, metric  # the x axis label
    # the sample strips of both steps (a small flat-colour PNG goes in as it is, any other image as a JPEG)
    assert len(re.findall(r'src="data:image/(?:png|jpeg);base64,', dom)) >= 8
    assert 'class="strip-note"' in dom and "the first, the last" in dom
    assert "step-00000002/rollout.html" in dom and '"name": "browser-' in dom  # deck pages, the config


def _ink(im: Image.Image, box: tuple[int, int, int, int]) -> int:
    """Dark pixels (text, tick marks, spines) in ``box``."""
    region = im.crop(box).convert("L")
    return sum(count for value, count in enumerate(region.histogram()) if value < 128)


def test_screenshot_of_a_chart_shows_its_axes(report_index, tmp_path):
    """The first chart of the report alone on a page draws its tick labels where the axes are: left of the plot
    (y) and below it (x, with the step label) there is more ink than in the same chart with its text removed. Font
    independent: any font draws some pixels (a count calibrated to one font's glyphs is not)."""
    svg = _svgs(_dom(report_index, tmp_path), "curve")[0]
    w, h = (int(float(v)) for v in re.search(r'width="([\d.]+)pt" height="([\d.]+)pt"', svg).groups())
    w, h = round(w * 4 / 3), round(h * 4 / 3)  # pt -> CSS px
    shots = {}
    for name, chart in (("chart", svg), ("bare", re.sub(r"<text[^>]*>[^<]*</text>", "", svg))):
        page = tmp_path / f"{name}.html"
        page.write_text("<!doctype html><html><body style='margin:0;background:#fff'>"
                        f"{chart.replace('margin:4px', 'margin:0')}</body></html>")
        shots[name] = _screenshot(page, tmp_path, (w + 40, h + 40))
    for axis, box in (("y", (2, int(h * 0.1), int(w * 0.16), int(h * 0.8))),  # y tick labels
                      ("x", (int(w * 0.18), int(h * 0.82), w - 4, h - 2))):  # x tick labels and "step"
        drawn, bare = _ink(shots["chart"], box), _ink(shots["bare"], box)
        assert drawn > bare, f"no {axis}-axis tick labels drawn ({drawn} dark px with text, {bare} without)"


def test_screenshot_is_not_blank(report_index, tmp_path):
    rgb = _screenshot(report_index, tmp_path, (1280, 1600))
    assert rgb.size == (1280, 1600)
    colors = rgb.getcolors(maxcolors=1 << 20)
    non_white = sum(n for n, c in colors if c != (255, 255, 255))
    assert len(colors) > 200, "a text-only or blank page has few colours; thumbnails and curves add many"
    assert non_white > 0.02 * 1280 * 1600


def _table(dom: str, css_class: str) -> str:
    m = re.search(rf'<table class="{css_class}".*?</table>', dom, flags=re.S)
    assert m, f"no table of class {css_class}"
    return m.group(0)


def test_flow_decks_render_grid_histogram_statistics_and_timings(report_index, tmp_path):
    step = report_index.parent / "step-00000002"
    rollout = _dom(step / "rollout.html", tmp_path)
    assert len(re.findall(r'src="data:image/(?:png|jpeg);base64,', _table(rollout, "sample-grid"))) == 8
    assert "time/rollout" in _table(rollout, "timings") or "rollout/seconds" in _table(rollout, "timings")
    reward = _dom(step / "reward.html", tmp_path)
    assert "jpeg_compressibility" in _table(reward, "reward-components")
    hists = _svgs(reward, "histogram")
    assert len(hists) >= 2 and all(len(_tick_numbers(s)) >= 4 for s in hists)  # component and total, with axes
    assert "<rect" in hists[0] or "<path" in hists[0]
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
