"""A compose run in plain Python: the phase functions the Flyte tasks call, chained in this process."""

from __future__ import annotations

import math
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
from unirl_core.loop.local import run_steps, timed
from unirl_core.types import SampleBatch


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


def compose_step(cfg: ComposeRunConfig, refs: Refs, step: int) -> tuple[Refs, SampleBatch, dict[str, float]]:
    """One step: rollout -> score -> train -> publish; returns the published refs, the scored batch, metrics."""
    t: dict[str, float] = {}
    metrics: dict[str, float] = {}
    batch = timed(t, metrics, "rollout", rollout_phase, cfg, refs, step=step)
    batch = timed(t, metrics, "score", score_phase, cfg, batch)
    refs = timed(t, metrics, "train", train_phase, cfg, batch, refs, step=step)
    t1 = time.perf_counter()
    refs = publish_stacks(cfg, refs)
    t["publish"] = time.perf_counter() - t1
    metrics.update({f"time/{k}": v for k, v in t.items()})
    return refs, batch, metrics


def run_compose_local(cfg: ComposeRunConfig, *, resume_from: str = "latest", progress: bool | None = None,
                      on_step: Callable[[dict, SampleBatch], None] | None = None) -> list[dict]:
    """Run the remaining steps of ``cfg.loop.total_steps`` in this process on the loop's driver
    (``loop.local.run_steps``); returns per-step metrics (step 0's evaluation first, when there is one). Each step is
    recorded in the run report (``<root>/<name>/report``) and goes to the metric sinks ``cfg.report`` asks for
    (TensorBoard, W&B)."""
    refs = init_stacks(cfg, resume_from=resume_from)
    start: list[dict] = []

    def evaluate_start() -> tuple[dict, str]:
        metrics, texts = evaluate_compose(cfg, refs, cfg.eval)
        write_step_report(cfg, 0, None, metrics, texts)
        start.append({**metrics, "step": 0.0})
        return metrics, (f"step 0/{cfg.loop.total_steps} | eval {metrics['eval/reward/mean']:.4f} "
                         f"(copy {metrics['eval/copy_reward/mean']:.4f})")

    def step(n: int) -> tuple[dict, SampleBatch]:
        nonlocal refs
        refs, batch, metrics = compose_step(cfg, refs, n)
        texts = None
        if cfg.eval is not None and cfg.eval.due(n, cfg.loop.total_steps):
            t0 = time.perf_counter()
            m, texts = evaluate_compose(cfg, refs, cfg.eval)
            metrics.update(m)
            metrics["time/eval"] = time.perf_counter() - t0
        write_step_report(cfg, n, batch, metrics, texts)
        return metrics, batch

    history = run_steps(cfg, cfg.run_root, "compose", step_of(cfg, refs) + 1, step,
                        show=cfg.report.progress if progress is None else progress, on_step=on_step,
                        line=lambda n, t, m, seconds, _eta: progress_line(n, t, m, seconds),
                        evaluate_start=evaluate_start)
    return start + history
