"""Sibling branches in the run report: a parent run and its forks (``checkpoint.fork_from``) side by side from the
fork point - reward, held-out eval, ratio and KL per branch on one chart each, and a table of their means after the
fork.

The family of a run is read from the store: a fork's versions name their parent (``extra.json["lineage"]``), a
parent names its forks by their pins (``<parent>/forks/<fork>.json``, written when the fork starts). Each branch's
numbers come from its own report (``<run>/report/step-*/metrics.json`` and ``eval/``); a branch without a report yet
is listed without numbers.
"""

from __future__ import annotations

import html
import json
import logging
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field

import fsspec

from unirl_core.checkpoint import CheckpointStore, load_version_json
from unirl_core.checkpoint.ref import parse_step_dirname
from unirl_core.checkpoint.store import EXTRA
from unirl_core.report.charts import line_chart_svg

log = logging.getLogger(__name__)

BRANCH_METRICS = (("reward", ("reward/mean", "reward_mean", "reward/total_mean")),
                  ("eval reward", ("eval/reward/mean",)),
                  ("ratio", ("train/ratio_mean", "ratio_mean", "train/ratio")),
                  ("KL", ("train/kl", "train/approx_kl", "train/kl_mean")))
"""(label, metric keys, the first present counts) compared across branches."""


@dataclass(kw_only=True)
class Branch:
    """One run of a family: the parent (``fork_step`` None) or a fork of it at ``fork_step``."""

    run: str
    fork_step: int | None
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    """Label (``BRANCH_METRICS``) -> step -> value."""


def family(root: str, run: str, *, storage_options: Mapping | None = None) -> tuple[str, list[Branch]] | None:
    """``(parent, branches)`` of the family ``run`` belongs to (the parent first, then its forks by fork step and
    name); None when ``run`` is neither a fork nor forked."""
    opts = dict(storage_options or {})
    parent = run
    latest = CheckpointStore(root, run, storage_options=opts).latest()
    if latest is not None:
        extra = load_version_json(latest, EXTRA, storage_options=opts) or {}
        lineage = extra.get("lineage") if isinstance(extra, dict) else None
        if isinstance(lineage, dict) and isinstance(lineage.get("parent_run"), str):
            parent = lineage["parent_run"]
    pins = CheckpointStore(root, parent, storage_options=opts).pinned_steps()
    forks = sorted((step, name) for step, names in pins.items() for name in names)
    if not forks:
        return None
    return parent, [Branch(run=parent, fork_step=None), *(Branch(run=n, fork_step=s) for s, n in forks)]


def load_series(root: str, branch: Branch, *, storage_options: Mapping | None = None) -> None:
    """Fill ``branch.series`` from its run report (steps and evals); nothing when it has none."""
    fs, path = fsspec.core.url_to_fs(root, **dict(storage_options or {}))
    report = posixpath.join(path.rstrip("/"), branch.run, "report")
    try:
        names = [posixpath.basename(p.rstrip("/")) for p in fs.ls(report, detail=False)]
    except FileNotFoundError:
        return
    rows: list[tuple[int, dict]] = []
    for name in names:
        if (step := parse_step_dirname(name)) is not None:
            try:
                rows.append((step, json.loads(fs.cat_file(posixpath.join(report, name, "metrics.json")))["metrics"]))
            except (FileNotFoundError, ValueError, KeyError):
                continue
    try:
        for name in fs.ls(posixpath.join(report, "eval"), detail=False):
            base = posixpath.basename(name)
            step = parse_step_dirname(base[:-len(".json")]) if base.endswith(".json") else None
            if step is not None and not base.endswith(".cells.json"):
                rows.append((step, json.loads(fs.cat_file(name)).get("metrics", {})))
    except FileNotFoundError:
        pass
    for step, metrics in rows:
        for label, keys in BRANCH_METRICS:
            key = next((k for k in keys if isinstance(metrics.get(k), (int, float))), None)
            if key is not None:
                branch.series.setdefault(label, {})[step] = float(metrics[key])


def branches_html(root: str, run: str, *, storage_options: Mapping | None = None) -> str:
    """The report section of ``run``'s family ("" when it has none): one chart per compared metric (a curve per
    branch, from the earliest fork point on) and a table of each branch's mean after its fork point."""
    found = family(root, run, storage_options=storage_options)
    if found is None:
        return ""
    parent, branches = found
    for b in branches:
        load_series(root, b, storage_options=storage_options)
    trunk = branches[0].series
    for b in branches[1:]:  # at its fork point a fork is its parent: its curve starts from the parent's value there
        for label, points in trunk.items():
            if b.fork_step in points:
                b.series.setdefault(label, {}).setdefault(b.fork_step, points[b.fork_step])
    start = min(b.fork_step for b in branches if b.fork_step is not None)

    def after(b: Branch, label: str) -> list[tuple[int, float]]:
        since = start if b.fork_step is None else b.fork_step
        return sorted((s, v) for s, v in b.series.get(label, {}).items() if s >= since)

    def name(b: Branch) -> str:
        return f"{b.run} (parent)" if b.fork_step is None else f"{b.run} @ {b.fork_step}"

    charts = []
    for label, _ in BRANCH_METRICS:
        curves = {name(b): after(b, label) for b in branches if after(b, label)}
        if len(curves) >= 2:
            first, *rest = curves
            charts.append(line_chart_svg(curves[first], title=f"{label} by branch", label=first, smooth=None,
                                         series={k: curves[k] for k in rest}))
    head = "".join(f"<th>{html.escape(label)} (mean after fork)</th>" for label, _ in BRANCH_METRICS)
    rows = []
    for b in branches:
        cells = []
        for label, _ in BRANCH_METRICS:
            # the parent from each fork point is its trunk; its row averages its steps after the earliest one
            vals = [v for s, v in after(b, label) if s > (start if b.fork_step is None else b.fork_step)]
            cells.append(f"<td>{sum(vals) / len(vals):.4g}</td>" if vals else "<td></td>")
        steps = sorted(set().union(*(b.series.get(label, {}) for label, _ in BRANCH_METRICS)))
        mark = " style='font-weight:bold'" if b.run == run else ""
        rows.append(f"<tr{mark}><td>{html.escape(b.run)}</td><td>{'' if b.fork_step is None else b.fork_step}"
                    f"</td><td>{steps[-1] if steps else ''}</td>{''.join(cells)}</tr>")
    return (f"<h3>branches of {html.escape(parent)}</h3><p>The parent run and its forks (checkpoint.fork_from), from "
            f"the earliest fork point (step {start}) on; each fork's curve starts at its own fork point, where it "
            f"equals the parent.</p><div class='charts'>{''.join(c for c in charts if c)}</div>"
            f"<table border='1' cellspacing='0' cellpadding='3' style='font-size:12px' class='branches'><tr><th>run"
            f"</th><th>forked at</th><th>last step</th>{head}</tr>{''.join(rows)}</table>")
