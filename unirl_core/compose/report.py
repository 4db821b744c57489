"""The compose run's report: the run report of the RL loop (``unirl_core.report.run_report.RunReport``,
``<checkpoint.root>/<name>/report/``) with a ``samples`` page per step - the original prompt, the enhanced prompt,
the image, both Parts' rewards and advantages - and the two stacks' curves on the index.
"""

from __future__ import annotations

import html
import math

from unirl_core.compose.config import ComposeRunConfig
from unirl_core.report.preview import thumbnail_data_uri
from unirl_core.report.run_report import RunReport
from unirl_core.types import SampleBatch

CURVES = ("enhancer/reward/mean", "enhancer/train/loss", "image/train/loss", "enhancer/train/ratio_mean",
          "image/train/ratio_mean", "rollout/enhancer_tokens_mean")
"""The stacks' curves, charted beside the run report's own (reward, eval, timings)."""
MAX_ROWS = 64


def _f(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def samples_html(batch: SampleBatch, *, max_rows: int = MAX_ROWS) -> str:
    """A table: sample id, original prompt, enhanced prompt (Part 0), image (Part 1), rewards, advantages."""
    rows = []
    for s in batch.samples[:max_rows]:
        ar, img = s.parts[0], s.parts[-1]
        pic = f'<img src="{thumbnail_data_uri(img.media)}" width="64">' if img.media else ""
        comps = ", ".join(f"{html.escape(k)}={v:.3g}" for i, (k, v) in enumerate(img.rewards.items())
                          if v or i == 0)  # the first component (the recipe's main one) even at 0
        rows.append(f"<tr><td>{html.escape(s.sample_id)}</td><td>{html.escape(img.prompt)}</td>"
                    f"<td>{html.escape(ar.text or '')}</td><td>{pic}</td><td>{_f(img.reward)}</td>"
                    f"<td>{_f(img.advantage)}</td><td>{_f(ar.reward)}</td><td>{_f(ar.advantage)}</td>"
                    f"<td>{comps}</td><td>v{ar.policy_version} / v{img.policy_version}</td></tr>")
    head = ("<tr><th>sample</th><th>prompt</th><th>enhanced prompt</th><th>image</th><th>image reward</th>"
            "<th>image adv.</th><th>enhancement reward (mean)</th><th>enhancement adv.</th><th>components</th>"
            "<th>versions (enhancer / image)</th></tr>")
    more = f"<p>{len(batch) - max_rows} more samples not shown</p>" if len(batch) > max_rows else ""
    return f"<table border=1 cellspacing=0 cellpadding=3>{head}{''.join(rows)}</table>{more}"


def _eval_html(enhancements: dict[str, str] | None) -> str:
    if not enhancements:
        return ""
    rows = "".join(f"<tr><td>{html.escape(p)}</td><td>{html.escape(t)}</td></tr>" for p, t in enhancements.items())
    return f"<h3>evaluation: greedy enhancement per prompt</h3><table border=1 cellspacing=0 cellpadding=3>{rows}</table>"


def write_step_report(cfg: ComposeRunConfig, step: int, batch: SampleBatch | None, metrics: dict[str, float],
                      enhancements: dict[str, str] | None = None) -> str:
    """Record step ``step`` in the run report (its metrics, its ``samples`` page: the sample table and
    ``enhancements``, the evaluation's greedy rewrites) and re-render the index on the steps
    ``report.index_every_n_steps`` names (as an RL run's report task does); returns the index URI. ``batch`` None
    (step 0's evaluation): no sample table."""
    report = RunReport(cfg.run_root, storage_options=cfg.checkpoint.storage_options)
    body = (samples_html(batch) if batch is not None else "") + _eval_html(enhancements)
    report.record_step(step, metrics={k: v for k, v in metrics.items() if k != "step"}, batch=batch,
                       pages={"samples": body} if body else None)
    if not cfg.report.renders_index(step, cfg.loop.total_steps):
        return report.index_uri
    stacks = ", ".join(f"{s} {'frozen' if getattr(cfg, s).frozen else 'trained'}" for s in ("enhancer", "image"))
    return report.render(f"{cfg.name} (prompt enhancement: {stacks})", curves=CURVES)
