"""Held-out evaluation in the run report: per-prompt sample strips of each evaluated version, and the index's
"before / after" section (the first evaluated version, normally step 0 before any update, next to the last).

Layout under ``<checkpoint root>/<run>/report/``::

    eval/step-00000000.json   the eval/* metrics of that version, per-prompt mean rewards, the prompts
    eval/step-00000000.cells.json   per held-out prompt, the HTML of its samples (thumbnails or completions)

Every eval record is small (16 prompts x 2 thumbnails of 48 px: ~40 KB), and the index embeds two of them.
"""

from __future__ import annotations

import html
import json
from collections import OrderedDict
from dataclasses import dataclass, field

from unirl_core.report.preview import thumbnail_data_uri
from unirl_core.report.text import display_html
from unirl_core.types import SampleBatch

EVAL_DIR = "eval"
EVAL_THUMB_PX = 48
DIGEST_KEYS = ("weights_sha256", "protocol_sha256")
EVAL_SUMMARY_KEYS = ("eval/reward/mean", "eval/accuracy")
"""Metrics shown first in the before/after table (when present); every other eval/* metric follows."""


@dataclass(frozen=True, kw_only=True)
class EvalRecord:
    """What the report keeps of one evaluated version (the content of ``eval/step-XXXXXXXX.json``)."""

    step: int
    """Training step of the evaluated version (0: the starting policy)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The eval phase's ``eval/*`` metrics."""
    prompts: list[str] = field(default_factory=list)
    """Held-out prompts, in eval order."""
    prompt_reward: list[float | None] = field(default_factory=list)
    """Mean reward of each prompt's valid samples (None: none valid)."""
    digests: dict[str, str] = field(default_factory=dict)
    """What the numbers measured (``unirl_core.loop.eval_cache``): ``weights_sha256`` of the evaluated weights and
    ``protocol_sha256`` of the evaluation protocol."""


def group_by_prompt(batch: SampleBatch) -> OrderedDict[str, list]:
    """The batch's samples grouped by prompt text, in first-appearance order."""
    groups: OrderedDict[str, list] = OrderedDict()
    for s in batch.samples:
        groups.setdefault(s.generated.prompt, []).append(s)
    return groups


def eval_record(step: int, batch: SampleBatch, metrics: dict[str, float]) -> EvalRecord:
    """The record of one eval batch: its metrics and each prompt's mean reward."""
    prompts, means = [], []
    for prompt, samples in group_by_prompt(batch).items():
        vals = [s.generated.reward for s in samples if s.generated.reward is not None]
        prompts.append(prompt)
        means.append(sum(vals) / len(vals) if vals else None)
    return EvalRecord(step=step, metrics={k: float(v) for k, v in metrics.items() if k.startswith("eval/")},
                      prompts=prompts, prompt_reward=means,
                      digests={k: str(batch.metadata[k]) for k in DIGEST_KEYS if k in batch.metadata})


def _cell(samples: list) -> str:
    """One prompt's samples: thumbnails with their rewards (images) or the completions (text)."""
    out = []
    for s in samples:
        p = s.generated
        r = "" if p.reward is None else f"{p.reward:.2f}"
        if p.media:
            out.append(f"<figure style='display:inline-block;margin:1px'><img src='"
                       f"{thumbnail_data_uri(p.media, EVAL_THUMB_PX)}' width='{EVAL_THUMB_PX}'><figcaption "
                       f"style='font-size:9px'>{r}</figcaption></figure>")
        else:
            out.append(f"<div style='font-size:11px'>{display_html(p.text or '', 80)} <b>{r}</b></div>")
    return "".join(out)


def eval_strip_html(batch: SampleBatch) -> dict[str, str]:
    """Per prompt text, the HTML of its samples (see ``_cell``)."""
    return {prompt: _cell(samples) for prompt, samples in group_by_prompt(batch).items()}


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def before_after_html(first: EvalRecord, first_cells: dict[str, str], last: EvalRecord,
                      last_cells: dict[str, str]) -> str:
    """The index's held-out section: metrics of the first and the last evaluated version side by side, then one
    row per prompt with both versions' samples and mean rewards."""
    keys = [k for k in EVAL_SUMMARY_KEYS if k in first.metrics or k in last.metrics]
    keys += sorted(k for k in {*first.metrics, *last.metrics} if k not in keys and "seconds" not in k
                   and k not in ("eval/step", "eval/samples"))
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(first.metrics.get(k))}</td>"
                   f"<td>{_fmt(last.metrics.get(k))}</td></tr>" for k in keys)
    table = (f"<table class='eval-metrics' border='1' cellspacing='0' cellpadding='3' style='font-size:12px'>"
             f"<tr><th>metric</th><th>step {first.step}</th><th>step {last.step}</th></tr>{rows}</table>")
    before = dict(zip(first.prompts, first.prompt_reward))
    after = dict(zip(last.prompts, last.prompt_reward))
    prompt_rows = "".join(
        f"<tr class='eval-prompt'><td>{html.escape(p[:100])}</td><td>{_fmt(before.get(p))}</td>"
        f"<td>{first_cells.get(p, '')}</td><td>{_fmt(after.get(p))}</td><td>{last_cells.get(p, '')}</td></tr>"
        for p in dict.fromkeys([*first.prompts, *last.prompts]))
    strips = (f"<table class='eval-strips' border='1' cellspacing='0' cellpadding='2' style='font-size:12px'>"
              f"<tr><th>held-out prompt</th><th>step {first.step}</th><th>samples</th><th>step {last.step}</th>"
              f"<th>samples</th></tr>{prompt_rows}</table>")
    return (f"<h3>held-out evaluation: step {first.step} vs step {last.step}</h3>"
            "<p>Deterministic sampling (ODE for diffusion, greedy for LMs) from fixed noise on prompts the "
            "training set does not contain; per prompt the mean reward and every sample.</p>"
            f"{table}{strips}")


def dump_record(rec: EvalRecord, cells: dict[str, str]) -> tuple[str, str]:
    """The file contents of one eval record: ``step-XXXXXXXX.json`` and ``step-XXXXXXXX.cells.json``."""
    return json.dumps(rec.__dict__, indent=1), json.dumps(cells)


def load_record(raw_json: bytes, raw_cells: bytes | None) -> tuple[EvalRecord, dict[str, str]]:
    """Inverse of ``dump_record``."""
    return EvalRecord(**json.loads(raw_json)), (json.loads(raw_cells) if raw_cells else {})
