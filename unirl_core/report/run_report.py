"""The run directory of a training run and its HTML run report (works on a local dir or ``s3://``).

Layout under ``<checkpoint root>/<run>/report/``::

    config.json                    the whole run config
    step-00000003/metrics.json     every phase's metrics of step 3, wall time, session, page names
    step-00000003/rewards.csv      one row per sample: ids, total reward, components, advantage, valid
    step-00000003/grid.html        a small sample strip (thumbnails or text) embedded in the index
    step-00000003/<phase>.html     the phase pages (the same HTML the Flyte decks show)
    steps.json                     every step's record (what metrics.json holds), read to render the index
    index.html                     reward curve (inline SVG), metric curves, per-step rows, config

Why our own report: local flytekit runs write decks to random temp folders, one file per task; the run
report collects a whole run in one page that opens from the checkpoint root, without a Flyte UI.
"""

from __future__ import annotations

import csv
import html
import io
import json
import logging
import posixpath
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import fsspec

from unirl_core.checkpoint.ref import parse_step_dirname, step_dirname
from unirl_core.errors import ConfigError, field_error
from unirl_core.report.preview import thumbnail_data_uri
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

REPORT_DIR = "report"
SUMMARY = "steps.json"
GRID_SAMPLES = 8
INDEX_GRID_STEPS = 20  # newest steps whose sample strips are embedded in index.html (keeps it small)
REWARD_KEYS = ("reward/mean", "reward_mean", "reward/total_mean", "rewards/mean")
RATIO_KEYS = ("train/ratio_mean", "ratio_mean", "train/ratio", "ratio")
CURVE_METRICS = ("train/loss", "train/kl", "train/ratio_mean", "train/clip_frac", "train/grad_norm")
"""Curves drawn besides the reward means (the rest of the metrics are in each step's metrics.json)."""


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What the report keeps of one step (the content of ``step-XXXXXXXX/metrics.json``)."""

    step: int
    """Training step."""
    time: float
    """Unix time the step was recorded (end of the step)."""
    session: str = ""
    """Id of the execution that recorded it; step times are only measured within one session."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Every phase's metrics, keys like ``reward/mean`` or ``train/loss``."""
    pages: dict[str, str] = field(default_factory=dict)
    """Phase name -> file name of its page inside the step folder."""


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family:sans-serif'>{body}</body></html>")


def pick_metric(metrics: Mapping[str, float], keys: tuple[str, ...]) -> float | None:
    """The first of ``keys`` present in ``metrics`` (metric names differ slightly between algorithms)."""
    for k in keys:
        if k in metrics:
            return float(metrics[k])
    return None


class RunReport:
    """Writes per-step artifacts and renders ``index.html`` in ``<run_uri>/report``."""

    def __init__(self, run_uri: str, *, storage_options: Mapping[str, object] | None = None) -> None:
        if not run_uri:
            raise field_error(ConfigError, "run_uri", run_uri, "a directory or s3:// URL of the run",
                              "pass '<checkpoint root>/<run>'")
        self.fs, path = fsspec.core.url_to_fs(run_uri, **dict(storage_options or {}))
        self.path = posixpath.join(path.rstrip("/"), REPORT_DIR)
        self.fs.makedirs(self.path, exist_ok=True)

    @property
    def uri(self) -> str:
        """URL of the report folder."""
        return self.fs.unstrip_protocol(self.path)

    @property
    def index_uri(self) -> str:
        return self.fs.unstrip_protocol(posixpath.join(self.path, "index.html"))

    def _write(self, rel: str, data: str | bytes) -> None:
        path = posixpath.join(self.path, rel)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self.fs.pipe_file(path, data.encode() if isinstance(data, str) else data)

    def _read(self, rel: str) -> bytes | None:
        try:
            return self.fs.cat_file(posixpath.join(self.path, rel))
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------------------------------------ write

    def write_config(self, config: Mapping[str, object]) -> None:
        """Save the run config (plain data, as ``to_dict(cfg)`` gives it)."""
        self._write("config.json", json.dumps(config, indent=1, sort_keys=True, default=str))

    def record_step(self, step: int, *, metrics: Mapping[str, float], batch: SampleBatch | None = None,
                    pages: Mapping[str, str] | None = None, session: str = "") -> StepRecord:
        """Write step ``step``'s artifacts (overwriting an earlier record of the same step)."""
        folder = step_dirname(step)
        names = {}
        for phase, body in (pages or {}).items():
            names[phase] = f"{phase}.html"
            self._write(f"{folder}/{phase}.html", _page(f"step {step} {phase}", body))
        if batch is not None:
            self._write(f"{folder}/rewards.csv", rewards_csv(batch))
            self._write(f"{folder}/grid.html", sample_strip_html(batch))
        rec = StepRecord(step=step, time=time.time(), session=session,
                         metrics={k: float(v) for k, v in metrics.items()}, pages=names)
        self._write(f"{folder}/metrics.json", json.dumps(rec.__dict__, indent=1, sort_keys=True))
        # one summary file keeps steps() at one read per step instead of one per recorded step (on S3 a long
        # run would otherwise pay thousands of GETs per step); a lost summary is rebuilt from the step folders
        others = [r for r in self.steps() if r.step != step]
        self._write(SUMMARY, json.dumps([r.__dict__ for r in sorted([*others, rec], key=lambda r: r.step)]))
        return rec

    # ------------------------------------------------------------------------------------------- read

    def steps(self) -> list[StepRecord]:
        """Every recorded step, in step order."""
        raw = self._read(SUMMARY)
        if raw is not None:
            return [StepRecord(**r) for r in json.loads(raw)]
        return self._scan_steps()

    def _scan_steps(self) -> list[StepRecord]:
        self.fs.invalidate_cache(self.path)
        try:
            names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False)]
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            step = parse_step_dirname(name)
            raw = self._read(f"{name}/metrics.json") if step is not None else None
            if raw is not None:
                out.append(StepRecord(**json.loads(raw)))
        return sorted(out, key=lambda r: r.step)

    def render(self, title: str = "run report") -> str:
        """(Re)write ``index.html`` from every recorded step; returns its URL."""
        records = self.steps()
        config = self._read("config.json")
        grids = {r.step: (self._read(f"{step_dirname(r.step)}/grid.html") or b"").decode()
                 for r in records[-INDEX_GRID_STEPS:]}
        self._write("index.html", _page(title, index_body(title, records, config, grids)))
        return self.index_uri


def step_seconds(records: list[StepRecord], session: str) -> list[float]:
    """Wall seconds of each step of ``session`` that directly follows another step of the same session."""
    mine = [r for r in records if r.session == session]
    return [b.time - a.time for a, b in zip(mine, mine[1:]) if b.step == a.step + 1]


def rewards_csv(batch: SampleBatch) -> str:
    """One row per sample: ids, total reward, each component, advantage, valid, policy version."""
    comps = sorted({k for p in batch.generated for k in p.rewards})
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["sample_id", "group_id", "reward", *comps, "advantage", "valid", "policy_version"])
    for s in batch:
        p = s.generated
        w.writerow([s.sample_id, s.group_id, p.reward, *(p.rewards.get(c) for c in comps), p.advantage,
                    p.valid, p.policy_version])
    return buf.getvalue()


def sample_strip_html(batch: SampleBatch, n: int = GRID_SAMPLES) -> str:
    """The first ``n`` samples as thumbnails with their rewards (images) or a short text table (LMs)."""
    cells = []
    for s in batch.samples[:n]:
        p = s.generated
        r = "" if p.reward is None else f"{p.reward:.3g}"
        if p.media:
            cells.append(f"<figure style='display:inline-block;margin:2px'><img src='{thumbnail_data_uri(p.media, 64)}'"
                         f" width='64' title='{html.escape(s.sample_id)}'><figcaption style='font-size:10px'>{r}"
                         "</figcaption></figure>")
        else:
            cells.append(f"<tr><td>{html.escape(p.prompt[:80])}</td><td>{html.escape((p.text or '')[:120])}</td>"
                         f"<td>{r}</td></tr>")
    if cells and cells[0].startswith("<tr>"):
        return ("<table class='samples' border='1' cellspacing='0' style='font-size:11px'>"
                "<tr><th>prompt</th><th>completion</th><th>reward</th></tr>" + "".join(cells) + "</table>")
    return "<div class='samples'>" + "".join(cells) + "</div>"


def line_chart_svg(points: list[tuple[int, float]], *, title: str, width: int = 360, height: int = 140) -> str:
    """A polyline chart of ``(step, value)`` points with min/max labels, as inline SVG."""
    pts = [(x, y) for x, y in points if y == y and abs(y) != float("inf")]
    if not pts:
        return ""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    pad, w, h = 30, width - 40, height - 40

    def sx(x: float) -> float:
        return pad + (x - x0) / ((x1 - x0) or 1) * w

    def sy(y: float) -> float:
        return 20 + h - (y - y0) / ((y1 - y0) or 1) * h

    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
    dots = "".join(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2.5' fill='#c24a4a'/>" for x, y in pts)
    return (f"<svg xmlns='http://www.w3.org/2000/svg' class='curve' data-metric='{html.escape(title)}' "
            f"width='{width}' height='{height}' style='border:1px solid #ccc;margin:4px'>"
            f"<text x='{width / 2}' y='14' font-size='12' text-anchor='middle'>{html.escape(title)}</text>"
            f"<polyline fill='none' stroke='#4a78c2' stroke-width='2' points='{line}'/>{dots}"
            f"<text x='2' y='{sy(y1) + 4:.1f}' font-size='9'>{y1:.3g}</text>"
            f"<text x='2' y='{sy(y0) + 4:.1f}' font-size='9'>{y0:.3g}</text>"
            f"<text x='{pad}' y='{height - 4}' font-size='9'>step {x0}</text>"
            f"<text x='{pad + w}' y='{height - 4}' font-size='9' text-anchor='end'>step {x1}</text></svg>")


def index_body(title: str, records: list[StepRecord], config: bytes | None, grids: Mapping[int, str]) -> str:
    """Body of ``index.html``: curves, one row per step (metrics, samples, page links), the config."""
    names = sorted({k for r in records for k in r.metrics
                    if k in CURVE_METRICS or (k.startswith("reward/") and k.endswith("mean"))})
    reward_key = next((k for k in REWARD_KEYS if any(k in r.metrics for r in records)), None)
    curves = [line_chart_svg([(r.step, r.metrics[reward_key]) for r in records if reward_key in r.metrics],
                             title=reward_key)] if reward_key else []
    curves += [line_chart_svg([(r.step, r.metrics[k]) for r in records if k in r.metrics], title=k)
               for k in names if k != reward_key]
    wanted = dict.fromkeys(k for k in (reward_key, *RATIO_KEYS, "train/loss", "train/kl") if k)
    shown = [k for k in wanted if any(k in r.metrics for r in records)]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in shown)
    rows = []
    for r in records:
        folder = step_dirname(r.step)
        links = " ".join(f"<a href='{folder}/{html.escape(f)}'>{html.escape(p)}</a>" for p, f in r.pages.items())
        links += f" <a href='{folder}/rewards.csv'>rewards.csv</a> <a href='{folder}/metrics.json'>metrics.json</a>"
        vals = "".join(f"<td>{r.metrics[k]:.4g}</td>" if k in r.metrics else "<td></td>" for k in shown)
        rows.append(f"<tr class='step-row' data-step='{r.step}'><td>{r.step}</td>{vals}<td>{links}</td>"
                    f"<td>{grids.get(r.step, '')}</td></tr>")
    cfg = html.escape(config.decode()) if config else "(no config recorded)"
    return (f"<h2>{html.escape(title)}</h2><p>{len(records)} steps recorded</p><div>{''.join(curves)}</div>"
            f"<table border='1' cellspacing='0' cellpadding='3' style='font-size:12px'><tr><th>step</th>{head}"
            f"<th>pages</th><th>samples</th></tr>{''.join(rows)}</table>"
            f"<h3>config</h3><pre style='font-size:11px'>{cfg}</pre>")
