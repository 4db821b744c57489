"""Eval: held-out prompts sampled deterministically (ODE / greedy) with a version's policy or EMA weights, scored.

It samples and scores, so it runs on the reward image (the rollout image's model stack plus the scorers) with a
GPU. The grpo workflow runs ``eval_task`` after the publish of every ``eval.every_n_steps``-th step and the last
one (its metrics join that step's report); ``evaluate_version_task`` serves the standalone ``evaluate`` workflow.
"""

from __future__ import annotations

import dataclasses

from flytekit import task

from images import reward_image
from tasks.common import (
    CACHE_VERSION,
    DECK,
    DEFAULT_ACCELERATOR,
    GPU_TASK,
    ROLLOUT_TIMEOUT,
    deck,
    phase,
)
from tasks.report import run_report, write_scalars
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config import RunConfig
from unirl_core.report.phase_html import reward_html

if reward_image.is_container():
    from unirl_core.loop import evaluate


def _evaluate(cfg: RunConfig, ckpt: CheckpointRef, weights: str | None) -> dict[str, float]:
    metrics: dict[str, float] = {}
    with phase("eval", metrics):
        batch, m = evaluate.eval_phase(cfg, ckpt, weights=weights or None)
    metrics.update(m)
    deck("eval", reward_html(batch, metrics))
    run_report(cfg).record_eval(ckpt.step, batch, metrics)  # per-prompt samples for the report's before/after
    if ckpt.step == 0:  # the starting policy: no report task carries its eval/* into TensorBoard
        write_scalars(cfg, 0, metrics)
    return metrics


@task(container_image=reward_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=2,
      timeout=ROLLOUT_TIMEOUT, cache=True, cache_version=CACHE_VERSION, **DECK)
def eval_task(cfg: RunConfig, ckpt: CheckpointRef) -> dict[str, float]:
    """``eval/*`` metrics of version ``ckpt`` under the run's ``eval`` section (deterministic: cached)."""
    return _evaluate(cfg, ckpt, None)


@task(container_image=reward_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=2,
      timeout=ROLLOUT_TIMEOUT, **DECK)
def evaluate_version_task(cfg: RunConfig, version: str, weights: str) -> dict[str, float]:
    """Evaluate a published version of the run (``latest`` or a version folder); ``weights``: '' (the eval
    section's), ``policy`` or ``ema``. A run without an ``eval`` section gets the default one."""
    if cfg.eval is None:
        cfg = dataclasses.replace(cfg, eval=evaluate.EvalConfig())
    return _evaluate(cfg, evaluate.resolve_version(cfg, version), weights)
