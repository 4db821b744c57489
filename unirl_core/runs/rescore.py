"""Re-score: what other rewards say about a run's stored samples, step by step, without training.

A run trained with ``checkpoint.keep_batches`` holds every step's batch (``<run>/batches/``). ``rescore`` scores
those samples with alternative rewards (any registered scorer, with its kwargs) and tabulates, per step, the mean
reward the run trained on against each alternative's mean, and the per-sample Pearson correlation between them -
the audit for reward hacking: a run whose own reward climbs while a reward of what it should do (faithfulness,
a held-out judge) stays flat or falls is optimising a loophole. The table goes to ``<run>/rescore/rescore.csv``
and a page of charts (``unirl_core.report.charts``, matplotlib SVG) and the table to ``<run>/rescore/rescore.html``.

CLI: ``python -m unirl_core.runs rescore <root>/<run> --reward SCORER [--reward NAME=SCORER:{json kwargs}]``.
"""

from __future__ import annotations

import csv
import dataclasses
import html
import io
import json
import logging
import math
import posixpath
from collections.abc import Sequence

import fsspec

from unirl_core.checkpoint import CheckpointStore, load_version_json
from unirl_core.checkpoint.batches import BatchStore
from unirl_core.errors import ConfigError, field_error
from unirl_core.checkpoint.store import CONFIG
from unirl_core.runs.replay import ReplayInputMissing, split_run
from unirl_core.plugins import import_plugins
from unirl_core.report.charts import line_chart_svg
from unirl_core.reward.config import RewardComponent, RewardConfig
from unirl_core.reward.service import RewardService
from unirl_core.types import Sample, SampleBatch

log = logging.getLogger(__name__)

RESCORE_DIR = "rescore"
RUN_COLUMN = "run"
"""The table's column of the reward the run trained on (``Part.reward`` as stored: after any shaping)."""


@dataclasses.dataclass(frozen=True)
class Alternative:
    """One reward to re-score with: its column name, its reward config and which Part of each Sample it scores."""

    name: str
    reward: RewardConfig
    part: int | None = None
    """None: the generated Part (what the run's reward scored); an index: that Part of every Sample, e.g. 0 for the
    enhancer's rewrite of a composed run (prompt: the original caption, text: the rewrite)."""


def alternative(scorer: str, *, name: str | None = None, kwargs: dict | None = None,
                part: int | None = None) -> Alternative:
    """One scorer (weight 1) as an alternative reward; a sample it cannot score is left out of its mean."""
    comp = RewardComponent(name=scorer, weight=1.0, kwargs=dict(kwargs or {}))
    return Alternative(name or scorer, RewardConfig(components=(comp,), failure_policy="mark_invalid"), part)


def parse_reward_arg(text: str) -> Alternative:
    """``[NAME=]SCORER[@PART][:{json kwargs}]`` (the CLI's ``--reward``): ``aesthetic``, ``inc=jpeg_incompressibility``,
    ``faith=caption_recall@0``, ``short=length_penalty:{"max_length": 4, "cache": 2}``."""
    head, _, raw = text.partition(":")
    name, _, scorer = head.rpartition("=")
    scorer, _, part = scorer.partition("@")
    if part and not part.lstrip("-").isdigit():
        raise field_error(ConfigError, "--reward", text, "SCORER@<Part index>", "e.g. caption_recall@0")
    kwargs = {}
    if raw:
        try:
            kwargs = json.loads(raw)
        except json.JSONDecodeError as e:
            raise field_error(ConfigError, "--reward", text, "SCORER[:<JSON object of kwargs>]",
                              f"the kwargs are not JSON ({e}); e.g. 'clip_score:{{\"model\": \"...\"}}'") from e
        if not isinstance(kwargs, dict):
            raise field_error(ConfigError, "--reward", text, "a JSON object after ':'", "e.g. 'x:{\"k\": 1}'")
    if not scorer:
        raise field_error(ConfigError, "--reward", text, "a scorer name", "e.g. --reward jpeg_compressibility")
    return alternative(scorer, name=name or None, kwargs=kwargs, part=int(part) if part else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RescoreRow:
    """One step: the run's mean reward, each alternative's mean and its per-sample correlation with the run's."""

    step: int
    samples: int
    run: float
    means: dict[str, float]
    correlations: dict[str, float]
    invalid: dict[str, int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RescoreTable:
    run: str
    alternatives: tuple[str, ...]
    rows: tuple[RescoreRow, ...]
    csv_uri: str = ""
    chart_uri: str = ""

    def columns(self) -> list[str]:
        return ["step", "samples", RUN_COLUMN, *self.alternatives, *(f"corr({RUN_COLUMN},{a})"
                                                                       for a in self.alternatives)]

    def records(self) -> list[list[object]]:
        return [[r.step, r.samples, r.run, *(r.means[a] for a in self.alternatives),
                 *(r.correlations[a] for a in self.alternatives)] for r in self.rows]

    def markdown(self) -> str:
        def cell(v: object) -> str:
            return f"{v:.4f}" if isinstance(v, float) else str(v)

        cols = self.columns()
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(cell(v) for v in rec) + " |" for rec in self.records()]
        return "\n".join(lines)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson's r of paired values (NaN when fewer than 2 pairs or either side is constant)."""
    if len(xs) < 2:
        return math.nan
    mx, my = _mean(xs), _mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def _scores(batch: SampleBatch) -> list[float | None]:
    return [p.reward if p.valid and p.reward is not None else None for p in batch.generated]


def part_view(batch: SampleBatch, part: int | None) -> SampleBatch:
    """``batch`` with every Sample cut down to its Part ``part`` (None: ``batch`` itself), for a scorer of that
    Part; an index no Sample has raises naming it."""
    if part is None:
        return batch
    try:
        return SampleBatch(samples=[Sample(sample_id=s.sample_id, group_id=s.group_id,
                                           parts=[dataclasses.replace(s.parts[part], parent=None)])
                                    for s in batch.samples], metadata=dict(batch.metadata))
    except IndexError:
        longest = max(len(s.parts) for s in batch.samples)
        raise field_error(ConfigError, "--reward ...@PART", part, f"a Part index of the run's Samples (they have "
                          f"{longest} Parts)", "drop @PART to score the generated Part") from None


def rescore_step(batches: BatchStore, step: int, services: dict[str, RewardService],
                 parts: dict[str, int | None] | None = None) -> RescoreRow:
    """Step ``step``'s stored batch scored by each service (each on a fresh read of the batch: scoring writes the
    rewards into it)."""
    own = _scores(batches.load(step))
    means, corr, invalid = {}, {}, {}
    for name, service in services.items():
        alt = _scores(service.score(part_view(batches.load(step), (parts or {}).get(name))))
        pairs = [(a, b) for a, b in zip(own, alt, strict=True) if a is not None and b is not None]
        means[name] = _mean([b for b in alt if b is not None])
        corr[name] = pearson([a for a, _ in pairs], [b for _, b in pairs])
        invalid[name] = sum(b is None for b in alt)
    return RescoreRow(step=step, samples=len(own), run=_mean([a for a in own if a is not None]), means=means,
                      correlations=corr, invalid=invalid)


def rescore(run: str, alternatives: Sequence[Alternative], *, steps: Sequence[int] | None = None,
            storage_options: dict | None = None, write: bool = True) -> RescoreTable:
    """Score the stored batches of ``run`` (``<checkpoint.root>/<run name>``) with each alternative reward; returns
    the per-step table and (``write``) writes it as CSV and a chart under ``<run>/rescore/``."""
    if not alternatives:
        raise field_error(ConfigError, "alternatives", [], "at least one reward", "e.g. --reward aesthetic")
    names = [a.name for a in alternatives]
    if len(set(names)) != len(names) or RUN_COLUMN in names:
        raise field_error(ConfigError, "alternatives", names, f"distinct names other than {RUN_COLUMN!r}",
                          "name them: --reward NAME=SCORER")
    root, name = split_run(run)
    batches = BatchStore(root, name, storage_options=storage_options)
    have = batches.steps()
    if not have:
        raise ReplayInputMissing(f"run {name!r} ({batches.uri}) stored no batches: train it with "
                                 "checkpoint.keep_batches=true to keep every step's samples for re-scoring")
    import_run_plugins(batches, have[-1], CheckpointStore(root, name, storage_options=storage_options))
    wanted = list(steps) if steps else have
    if missing := [s for s in wanted if s not in have]:
        raise ReplayInputMissing(f"run {name!r} stored no batch of steps {missing} (it has {have[0]}..{have[-1]}, "
                                 f"{len(have)} steps); checkpoint.keep_batches was off when they ran")
    services = {a.name: RewardService(a.reward) for a in alternatives}
    try:
        rows = tuple(rescore_step(batches, s, services, {a.name: a.part for a in alternatives}) for s in wanted)
    finally:
        for service in services.values():
            service.close()
    table = RescoreTable(run=name, alternatives=tuple(names), rows=rows)
    return write_table(table, posixpath.join(root.rstrip("/"), name, RESCORE_DIR), storage_options) if write \
        else table


def import_run_plugins(batches: BatchStore, step: int, store: CheckpointStore) -> None:
    """Import the plugins the run's config names (their scorers register): the config stored with step ``step``'s
    batch (an RL or a composed run's), else the run's newest version's."""
    data = batches.config(step)
    if data is None and (latest := store.latest()) is not None:
        data = load_version_json(latest, CONFIG, storage_options=store.storage_options)
    import_plugins((data or {}).get("plugins") or [])


def charts_svg(table: RescoreTable) -> list[str]:
    """One chart per reward (their scales differ): the run's mean reward per step, then each alternative's; then the
    per-sample correlation of each alternative with the run's reward, all on one chart ([-1, 1])."""
    steps = [r.step for r in table.rows]
    out = [line_chart_svg(list(zip(steps, [r.run for r in table.rows], strict=True)),
                          title=f"{RUN_COLUMN} (trained on)", smooth=None, ylabel="mean reward")]
    out += [line_chart_svg(list(zip(steps, [r.means[a] for r in table.rows], strict=True)), title=a, smooth=None,
                           ylabel="mean reward") for a in table.alternatives]
    corr = {f"corr({RUN_COLUMN},{a})": [(r.step, r.correlations[a]) for r in table.rows] for a in table.alternatives}
    first, *rest = corr
    out.append(line_chart_svg(corr[first], title=first, smooth=None, ylabel="Pearson r",
                              series={k: corr[k] for k in rest} or None))
    return [c for c in out if c]


def page_html(table: RescoreTable) -> str:
    """The table and the charts as one offline HTML page."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.columns())
    body = "".join("<tr>" + "".join(f"<td>{v:.4f}</td>" if isinstance(v, float) else f"<td>{v}</td>" for v in rec)
                   + "</tr>" for rec in table.records())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>re-scored: {html.escape(table.run)}</title>"
            f"</head><body style='font-family:sans-serif'><h2>Run {html.escape(table.run)} re-scored</h2>"
            f"<div>{''.join(charts_svg(table))}</div><table border='1' cellpadding='3' style='border-collapse:"
            f"collapse;font-size:12px'><tr>{head}</tr>{body}</table></body></html>")


def write_table(table: RescoreTable, folder: str, storage_options: dict | None = None) -> RescoreTable:
    """``rescore.csv`` and ``rescore.html`` (charts and table) into ``folder``; returns the table with their URLs."""
    fs, path = fsspec.core.url_to_fs(folder, **dict(storage_options or {}))
    fs.makedirs(path, exist_ok=True)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(table.columns())
    writer.writerows(table.records())
    csv_path, page_path = posixpath.join(path, "rescore.csv"), posixpath.join(path, "rescore.html")
    fs.pipe_file(csv_path, buf.getvalue().encode())
    fs.pipe_file(page_path, page_html(table).encode())
    log.info("re-scored %d steps of run %s: %s", len(table.rows), table.run, fs.unstrip_protocol(csv_path))
    return dataclasses.replace(table, csv_uri=fs.unstrip_protocol(csv_path), chart_uri=fs.unstrip_protocol(page_path))
