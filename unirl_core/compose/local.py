"""A compose run in plain Python: the phase functions the Flyte tasks call, chained in this process."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable

from unirl_core.compose.config import ComposeRunConfig
from unirl_core.compose.phases import (
    Refs,
    init_stacks,
    publish_stacks,
    rollout_phase,
    score_phase,
    step_of,
    train_phase,
)
from unirl_core.compose.evaluate import evaluate_compose
from unirl_core.compose.report import write_step_report
from unirl_core.report.tensorboard import ScalarLog
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)


def progress_line(step: int, total: int, m: dict[str, float], seconds: float) -> str:
    """``step k/N | reward | ratio enhancer / image | enhancement tokens | step time``."""
    def f(key: str) -> str:
        v = m.get(key, math.nan)
        return "-" if math.isnan(v) else f"{v:.4f}"

    line = (f"step {step}/{total} | reward {f('reward/mean')} | ratio enhancer {f('enhancer/train/ratio_mean')} "
            f"image {f('image/train/ratio_mean')} | enhancement tokens {f('rollout/enhancer_tokens_mean')} | ")
    if "eval/reward/mean" in m:
        line += f"eval {f('eval/reward/mean')} (copy {f('eval/copy_reward/mean')}) | "
    return line + f"step {seconds:.1f}s"


def _say(line: str, show: bool) -> None:
    log.info(line)
    if show:
        print(line, file=sys.stderr, flush=True)


def compose_step(cfg: ComposeRunConfig, refs: Refs, step: int) -> tuple[Refs, SampleBatch, dict[str, float]]:
    """One step: rollout -> score -> train -> publish; returns the published refs, the scored batch, metrics."""
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    batch, metrics = rollout_phase(cfg, refs, step=step)
    t["rollout"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    batch, m = score_phase(cfg, batch)
    metrics.update(m)
    t["score"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    refs, m = train_phase(cfg, batch, refs, step=step)
    metrics.update(m)
    t["train"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    refs = publish_stacks(cfg, refs)
    t["publish"] = time.perf_counter() - t1
    metrics.update({f"time/{k}": v for k, v in t.items()})
    metrics.update({"step": float(step), "time/step": time.perf_counter() - t0})
    return refs, batch, metrics


def run_compose_local(cfg: ComposeRunConfig, *, resume_from: str = "latest", progress: bool | None = None,
                      on_step: Callable[[dict, SampleBatch], None] | None = None) -> list[dict]:
    """Run the remaining steps of ``cfg.loop.total_steps`` in this process; returns per-step metrics. Each step
    writes its report page (``<root>/<name>/report``) and, with ``report.tensorboard``, TensorBoard scalars."""
    show = cfg.report.progress if progress is None else progress
    refs = init_stacks(cfg, resume_from=resume_from)
    total, history = cfg.loop.total_steps, []
    tb = ScalarLog(cfg.run_root, storage_options=cfg.checkpoint.storage_options) \
        if cfg.report.tensorboard and step_of(cfg, refs) < total else None
    try:
        if cfg.eval is not None and step_of(cfg, refs) == 0 < total:
            metrics, texts = evaluate_compose(cfg, refs, cfg.eval)
            write_step_report(cfg, 0, None, metrics, texts)
            history.append({**metrics, "step": 0.0})
            _say(f"step 0/{total} | eval {metrics['eval/reward/mean']:.4f} (copy {metrics['eval/copy_reward/mean']:.4f})",
                 show)
        for step in range(step_of(cfg, refs) + 1, total + 1):
            refs, batch, metrics = compose_step(cfg, refs, step)
            texts = None
            if cfg.eval is not None and cfg.eval.due(step, total):
                t0 = time.perf_counter()
                m, texts = evaluate_compose(cfg, refs, cfg.eval)
                metrics.update(m)
                metrics["time/eval"] = time.perf_counter() - t0
            write_step_report(cfg, step, batch, metrics, texts)
            if tb is not None:
                tb.log(step, metrics)
            history.append(metrics)
            _say(progress_line(step, total, metrics, metrics["time/step"]), show)
            if on_step is not None:
                on_step(metrics, batch)
    finally:
        if tb is not None:
            tb.close()
    return history
