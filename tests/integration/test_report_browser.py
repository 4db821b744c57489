"""The run report of a real (tiny, local) run opened in headless Chromium: it renders, with curves and images.

Needs Debian's ``chromium`` (``apt-get install -y chromium``)."""

from __future__ import annotations

import io
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
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise RuntimeError("headless Chromium is required: apt-get install -y chromium")
    return exe


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{uuid.uuid4().hex[:6]}"
    return subprocess.run([_chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          timeout=180)


@pytest.fixture(scope="module")
def report_index(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    name = f"browser-{uuid.uuid4().hex[:8]}"
    grpo(recipe="tiny-flow-grpo", overrides=tiny_overrides("tiny-flow-grpo", str(root), name, steps=2))
    return root / name / "report" / "index.html"


def test_dom_has_step_rows_curves_and_thumbnails(report_index, tmp_path):
    proc = _run(["--dump-dom", report_index.as_uri()], tmp_path)
    dom = proc.stdout.decode()
    assert proc.returncode == 0 and "</html>" in dom, proc.stderr.decode()[-2000:]
    assert dom.count('class="step-row"') == 2
    assert 'data-metric="reward/mean"' in dom and "<polyline" in dom
    assert dom.count('src="data:image/jpeg;base64,') >= 8  # the sample strips of both steps
    assert "step-00000002/rollout.html" in dom and '"name": "browser-' in dom  # deck pages, the config


def test_screenshot_is_not_blank(report_index, tmp_path):
    shot = tmp_path / "report.png"
    proc = _run([f"--screenshot={shot}", "--window-size=1280,1600", report_index.as_uri()], tmp_path)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr.decode()[-2000:]
    with Image.open(io.BytesIO(shot.read_bytes())) as im:
        rgb = im.convert("RGB")
        assert rgb.size == (1280, 1600)
        colors = rgb.getcolors(maxcolors=1 << 20)
    non_white = sum(n for n, c in colors if c != (255, 255, 255))
    assert len(colors) > 200, "a text-only or blank page has few colours; thumbnails and curves add many"
    assert non_white > 0.02 * 1280 * 1600


def test_a_deck_page_renders(report_index, tmp_path):
    page = report_index.parent / "step-00000001" / "reward.html"
    dom = _run(["--dump-dom", page.as_uri()], tmp_path).stdout.decode()
    assert "jpeg_compressibility" in dom and "<svg" in dom
