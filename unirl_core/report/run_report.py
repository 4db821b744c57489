"""The run directory of a training run and its HTML run report (works on a local dir or ``s3://``).

Layout under ``<checkpoint root>/<run>/report/``::

    config.json                    the whole run config
    step-00000003/metrics.json     every phase's metrics of step 3, wall time, session, page names
    step-00000003/rewards.csv      one row per sample: ids, total reward, components, advantage, valid
    step-00000003/grid.html        a small sample strip (thumbnails or text) embedded in the index
    step-00000003/<phase>.html     the phase pages (the same HTML the Flyte decks show)
    steps.json                     every step's record (what metrics.json holds), read to render the index
    index.html                     charts (inline SVG), per-step rows, spread sample strips, config

Size of index.html: charts are ~10-40 KB each (at most ``charts.MAX_POINTS`` points per curve, whatever the
run length), sample strips of at most ``STRIP_STEPS`` steps (~15-30 KB each with thumbnails), plus ~0.4 KB per
step row: ~0.5-1 MB for a short run, ~5 MB at 10,000 steps.

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
from unirl_core.report.branches import branches_html
from unirl_core.report.charts import line_chart_svg
from unirl_core.report.eval_report import (
    EVAL_DIR,
    EvalRecord,
    before_after_html,
    dump_record,
    eval_record,
    eval_strip_html,
    load_record,
)
from unirl_core.report.preview import thumbnail_data_uri
from unirl_core.report.text import display_html
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

REPORT_DIR = "report"
SUMMARY = "steps.json"
GRID_SAMPLES = 8
MAX_STRIP_BYTES = 48_000
"""A strip larger than this (never written by sample_strip_html: 8 thumbnails of 64 px) is not embedded."""
STRIP_STEPS = 12
"""Steps whose sample strips are embedded in index.html (first, last, evenly between): bounds the page size."""
SMOOTHING = 0.6
"""EMA smoothing of the index's curves (None: raw curves only)."""
REWARD_KEYS = ("reward/mean", "reward_mean", "reward/total_mean", "rewards/mean")
RATIO_KEYS = ("train/ratio_mean", "ratio_mean", "train/ratio", "ratio")
REWARD_STAT_KEYS = ("reward/num_invalid", "reward/num_samples", "reward/seconds")
POLICY_STATS = (("train/ratio_mean", ("train/ratio_min", "train/ratio_max")), ("train/clip_frac", ()),
                ("train/kl", ()), ("train/logp_absdiff_mean", ("train/logp_absdiff_max",)),
                ("rollout/decode_rescore_absdiff_max", ()), ("train/staleness_mean", ("train/staleness_max",)),
                ("train/is_weight_mean", ()), ("train/is_masked_frac", ("train/is_truncated_frac",)))
ASYNC_STATS = (("async/staleness_mean", ("async/staleness_max",)), ("async/buffer_depth", ("async/inflight",)),
               ("async/rollout_wait_s", ()), ("async/engine_idle_frac", ()))
"""Lagged rollouts (``async_training``): staleness, the manager's buffer, the trainer's wait for samples."""
"""Policy statistics charts: (metric, further metrics drawn on the same axes)."""
CURVE_METRICS = ("train/loss", "train/policy_loss", "train/grad_norm", "train/entropy")
"""Further curves (with every ``time/*`` phase timing on one chart); all metrics are in each metrics.json."""


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
        self.storage_options = dict(storage_options or {})
        self.fs, path = fsspec.core.url_to_fs(run_uri, **self.storage_options)
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

    def record_eval(self, step: int, batch: SampleBatch, metrics: Mapping[str, float]) -> EvalRecord:
        """Write the held-out eval of step ``step``'s version (metrics, per-prompt rewards and samples) to
        ``eval/``; the index shows the first and the last of them side by side."""
        rec = eval_record(step, batch, dict(metrics))
        raw, cells = dump_record(rec, eval_strip_html(batch))
        self._write(f"{EVAL_DIR}/{step_dirname(step)}.json", raw)
        self._write(f"{EVAL_DIR}/{step_dirname(step)}.cells.json", cells)
        return rec

    # ------------------------------------------------------------------------------------------- read

    def evals(self) -> list[tuple[EvalRecord, dict[str, str]]]:
        """Every recorded eval (record, per-prompt sample cells), in step order."""
        folder = posixpath.join(self.path, EVAL_DIR)
        self.fs.invalidate_cache(folder)
        try:
            names = [posixpath.basename(p) for p in self.fs.ls(folder, detail=False)]
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            step = parse_step_dirname(name[:-len(".json")]) if name.endswith(".json") else None
            if step is None or name.endswith(".cells.json"):
                continue
            raw = self._read(f"{EVAL_DIR}/{name}")
            if raw is not None:
                out.append(load_record(raw, self._read(f"{EVAL_DIR}/{step_dirname(step)}.cells.json")))
        return sorted(out, key=lambda rc: rc[0].step)

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

    def render(self, title: str = "run report", *, smooth: float | None = SMOOTHING,
               curves: tuple[str, ...] = ()) -> str:
        """(Re)write ``index.html`` from every recorded step; returns its URL.

        Sample strips of ``strip_steps`` only; ``smooth``: EMA smoothing of the curves (None: off); ``curves``:
        further metrics to chart (a composed run's per-stack keys)."""
        records = self.steps()
        config = self._read("config.json")
        grids = {}
        for s in strip_steps([r.step for r in records]):
            raw = self._read(f"{step_dirname(s)}/grid.html") or b""
            grids[s] = raw.decode() if len(raw) <= MAX_STRIP_BYTES else "(strip too large to embed)"
        evals = self.evals()
        held_out = before_after_html(*evals[0], *evals[-1]) if evals else ""
        run_path = posixpath.dirname(self.path)
        held_out += branches_html(self.fs.unstrip_protocol(posixpath.dirname(run_path)), posixpath.basename(run_path),
                                  storage_options=self.storage_options)
        self._write("index.html", _page(title, index_body(title, records, config, grids, smooth=smooth,
                                                          held_out=held_out, curves=curves,
                                                          evals=[e for e, _ in evals])))
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
            cells.append(f"<tr><td>{html.escape(p.prompt[:80])}</td><td>{display_html(p.text or '', 120)}</td>"
                         f"<td>{r}</td></tr>")
    if cells and cells[0].startswith("<tr>"):
        return ("<table class='samples' border='1' cellspacing='0' style='font-size:11px'>"
                "<tr><th>prompt</th><th>completion</th><th>reward</th></tr>" + "".join(cells) + "</table>")
    return "<div class='samples'>" + "".join(cells) + "</div>"


def strip_steps(steps: list[int], k: int = STRIP_STEPS) -> list[int]:
    """At most ``k`` of ``steps`` (sorted) for the index's sample strips: the first, the last and evenly spaced
    steps between, so the strips show how the samples change over the whole run."""
    steps = sorted(steps)
    if len(steps) <= k:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (k - 1))] for i in range(k)})


EVAL_BOOKKEEPING = ("eval/samples", "eval/sample_seconds", "eval/seconds", "eval/step", "eval/reward/num_samples",
                   "eval/reward/num_invalid", "eval/reward/seconds")
"""Eval metrics not charted (they are in every record's metrics.json)."""


def _eval_charts(records: list[StepRecord], evals: list[EvalRecord]) -> list[str]:
    """The held-out evaluation over the run: every evaluated version, the starting policy (step 0) included (its
    own record; no training step has it). One chart of the eval reward with its components' means beside it,
    then one per other eval metric (not the reward's spread or the bookkeeping)."""
    series: dict[str, dict[int, float]] = {}
    for step, metrics in [(r.step, r.metrics) for r in records] + [(e.step, e.metrics) for e in evals]:
        for k, v in metrics.items():
            if k.startswith("eval/") and k not in EVAL_BOOKKEEPING and isinstance(v, (int, float)):
                series.setdefault(k, {})[step] = float(v)

    def pts(k: str) -> list[tuple[int, float]]:
        return sorted(series[k].items())

    comps = [k for k in series if k.startswith("eval/reward/") and k.endswith("/mean") and k != "eval/reward/mean"]
    spread = {"eval/reward/std", "eval/reward/min", "eval/reward/max"}
    charts = []
    if "eval/reward/mean" in series:
        charts.append(line_chart_svg(pts("eval/reward/mean"), title="eval/reward/mean", smooth=None,
                                     series={k: pts(k) for k in comps} or None))
    rest = [k for k in sorted(series) if k != "eval/reward/mean" and k not in spread
            and ("eval/reward/mean" not in series or k not in comps)]
    return charts + [line_chart_svg(pts(k), title=k, smooth=None) for k in rest]


def _chart_groups(records: list[StepRecord], smooth: float | None, curves: tuple[str, ...] = (),
                  evals: list[EvalRecord] = ()) -> list[tuple[str, list[str]]]:
    """(section title, charts) of the index: reward and its components, eval, policy statistics, loss, time."""
    present = sorted({k for r in records for k in r.metrics})

    def pts(k: str) -> list[tuple[int, float]]:
        return [(r.step, r.metrics[k]) for r in records if k in r.metrics]

    def chart(k: str, series: tuple[str, ...] = (), **kw) -> str:
        extra = {s: pts(s) for s in series if s in present}
        return line_chart_svg(pts(k), title=k, smooth=smooth, series=extra or None, **kw)

    reward_key = next((k for k in REWARD_KEYS if k in present), None)
    comps = [k for k in present if k.startswith("reward/") and k != reward_key
             and (k.endswith("/mean") or k.count("/") == 1) and k not in REWARD_STAT_KEYS]
    stats = [chart(k, series) for k, series in POLICY_STATS if k in present]
    lagged = [chart(k, series) for k, series in ASYNC_STATS if k in present]
    other = [chart(k) for k in (*CURVE_METRICS, *curves) if k in present]
    times = sorted(k for k in present if k.startswith("time/"))
    if times:
        other.append(line_chart_svg(pts(times[0]), title="time per phase", label=times[0], smooth=None,
                                    series={k: pts(k) for k in times[1:]} or None, ylabel="seconds"))
    groups = [("reward", ([chart(reward_key)] if reward_key else []) + [chart(k) for k in comps]),
              ("eval", _eval_charts(records, evals)), ("policy statistics (ratio, clip, KL, logp drift)", stats),
              ("asynchronous rollouts (staleness, buffer, trainer wait)", lagged),
              ("optimisation and timings", other)]
    return [(t, [c for c in cs if c]) for t, cs in groups if any(cs)]


def index_body(title: str, records: list[StepRecord], config: bytes | None, grids: Mapping[int, str],
               *, smooth: float | None = SMOOTHING, held_out: str = "", curves: tuple[str, ...] = (),
               evals: list[EvalRecord] = ()) -> str:
    """Body of ``index.html``: charts, the held-out before/after section (``held_out``), one row per step
    (metrics, samples, page links), the config."""
    sections = "".join(f"<h3>{html.escape(t)}</h3><div class='charts'>{''.join(cs)}</div>"
                       for t, cs in _chart_groups(records, smooth, curves, evals))
    reward_key = next((k for k in REWARD_KEYS if any(k in r.metrics for r in records)), None)
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
    shown_strips = [s for s in grids if grids[s]]
    note = (f"<p class='strip-note'>Sample strips are shown for {len(shown_strips)} of {len(records)} steps: the "
            f"first, the last and up to {STRIP_STEPS - 2} evenly spaced steps between (a bounded page size); "
            "every step's samples are in its rewards.csv and rollout page.</p>")
    smooth_note = f" Thick lines are an EMA with smoothing {smooth:g}." if smooth is not None else ""
    cfg = html.escape(config.decode()) if config else "(no config recorded)"
    return (f"<h2>{html.escape(title)}</h2><p>{len(records)} steps recorded.{smooth_note}</p>{sections}"
            f"{held_out}<h3>steps</h3>{note}"
            f"<table border='1' cellspacing='0' cellpadding='3' style='font-size:12px'><tr><th>step</th>{head}"
            f"<th>pages</th><th>samples</th></tr>{''.join(rows)}</table>"
            f"<h3>config</h3><pre style='font-size:11px'>{cfg}</pre>")
