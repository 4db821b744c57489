"""The loop in plain Python: the same phase functions the Flyte tasks call, chained in-process.

It is the baseline of the orchestration benchmark and the quickest way to debug a recipe.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.run import RunConfig
from unirl_core.loop import resume
from unirl_core.loop.metrics import merge_shard_metrics
from unirl_core.loop.phases import (
    advantage_phase,
    init_run,
    publish_phase,
    reward_phase,
    rollout_phase,
    train_phase,
)
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

StepCallback = Callable[[dict, SampleBatch], None]


def progress_line(step: int, total: int, metrics: dict, step_seconds: float, eta_seconds: float) -> str:
    """``step k/N | reward mean | ratio | step time | ETA`` - one line per step."""
    reward = metrics.get("reward/mean", metrics.get("advantage/reward_mean", math.nan))
    ratio = metrics.get("train/ratio_mean", math.nan)
    return (f"step {step}/{total} | reward {reward:.4f} | ratio {ratio:.4f} | "
            f"step {step_seconds:.1f}s | ETA {eta_seconds:.0f}s")


def run_local(cfg: RunConfig, *, resume_from: str = "latest", fork_as: str | None = None,
              on_step: StepCallback | None = None) -> list[dict]:
    """Run ``cfg.loop.total_steps`` (from the resume point) in this process; returns per-step metrics,
    each with ``time/<phase>`` seconds spent inside phase compute.

    ``resume_from`` / ``fork_as``: as in ``init_run`` (with ``fork_as`` the steps train the new run).
    Ctrl-C: says at WARNING and on stderr which version was published last and the call that resumes,
    then re-raises the KeyboardInterrupt."""
    try:
        ckpt = init_run(cfg, resume_from=resume_from, fork_as=fork_as)
        return _run_steps(resume.forked_config(cfg, fork_as), ckpt, on_step)
    except KeyboardInterrupt:
        resume.tell(resume.interrupted_message(resume.forked_config(cfg, fork_as),
                                               resume.library_resume_command(cfg, resume_from, fork_as)))
        raise


def _run_steps(cfg: RunConfig, ckpt: CheckpointRef, on_step: StepCallback | None) -> list[dict]:
    total = cfg.loop.total_steps
    shards = cfg.loop.rollout_shards
    history: list[dict] = []
    started = time.perf_counter()
    for step in range(ckpt.step + 1, total + 1):
        t = {}
        t0 = time.perf_counter()
        parts, per_shard = [], []
        for shard in range(shards):
            b, m = rollout_phase(cfg, ckpt, step=step, shard=shard, num_shards=shards)
            parts.append(b)
            per_shard.append(m)
        metrics = merge_shard_metrics(per_shard)
        batch = SampleBatch.concat(parts)
        t["rollout"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        batch, m = reward_phase(cfg, batch)
        metrics.update(m)
        t["reward"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        batch, m = advantage_phase(cfg, batch, ckpt)
        metrics.update(m)
        t["advantage"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        ckpt, m = train_phase(cfg, batch, ckpt, step=step)
        metrics.update(m)
        t["train"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        publish_phase(cfg, ckpt)
        t["publish"] = time.perf_counter() - t1
        step_seconds = time.perf_counter() - t0
        metrics.update({f"time/{k}": v for k, v in t.items()})
        metrics.update({"step": float(step), "time/step": step_seconds})
        history.append(metrics)
        done = len(history)
        eta = (time.perf_counter() - started) / done * (total - step)
        log.info(progress_line(step, total, metrics, step_seconds, eta))
        if on_step is not None:
            on_step(metrics, batch)
    return history
