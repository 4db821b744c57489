"""The loop's phases in pool mode: same inputs and outputs as ``unirl_core.loop.phases``, run by the pool.

``loop.phases`` dispatches here when ``pool.execution == 'pool'``, so ``run_local`` and the Flyte tasks run
either mode unchanged. The advantage phase stays on the driver (a cheap pure function of the projection).
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.run import RunConfig
from unirl_core.errors import ConfigError, PoolActorDied, field_error
from unirl_core.pool.cluster import REWARD, TRAINER, Pool, engine_name
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)


def _engine_of(cfg: RunConfig, shard: int) -> str:
    return engine_name(shard % cfg.pool.num_engines)


def rollout_phase(cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int = 0, num_shards: int = 1,
                  weights: Literal["policy", "ema"] = "policy") -> tuple[SampleBatch, dict[str, float]]:
    """Sample one shard on its engine actor; returns the projection (``pool.emit``) and the metrics. The full
    batch stays in the pool for ``train_phase``."""
    if weights != "policy":
        raise field_error(ConfigError, "weights", weights, "'policy' in pool mode",
                          "sample EMA weights with execution 'pods' (the pool's engines hold the policy)")
    pool = Pool.get(cfg)
    name = _engine_of(cfg, shard)
    return pool.call(name, "rollout", ckpt, step, shard, num_shards, cfg.pool.emit,
                     what=f"rollout step {step} shard {shard}")


def reward_phase(cfg: RunConfig, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
    """Score the projection on the reward actor."""
    return Pool.get(cfg).call(REWARD, "score", batch, what=f"reward of {len(batch)} samples")


def train_phase(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *,
                step: int) -> tuple[CheckpointRef, dict[str, float]]:
    """Train step ``step`` on the trainer actor from the full batches the engines hold, with ``batch``'s
    (the scored projection's) advantages. A shard the pool no longer holds (its engine restarted, or the
    rollout came from a task cache) is sampled again from ``ckpt`` with the same seed and checked against
    the projection's log-probs before training."""
    pool = Pool.get(cfg)
    shards = cfg.loop.rollout_shards
    refs, resampled = [], 0
    for shard in range(shards):
        name = _engine_of(cfg, shard)
        what = f"train step {step}: fetching shard {shard}"
        got = pool.call(name, "batch_ref", step, shard, what=what)
        if not got:
            log.warning("pool: %s holds no batch of step %d shard %d; sampling it again from %s", name, step,
                        shard, ckpt.uri)
            pool.call(name, "rollout", ckpt, step, shard, shards, "projection", what=f"re-sampling {what}")
            got = pool.call(name, "batch_ref", step, shard, what=what)
            resampled += 1
        refs.extend(got)
    ref, metrics = pool.call(TRAINER, "train", ckpt, step, batch, *refs, what=f"train step {step}")
    for name in sorted({_engine_of(cfg, s) for s in range(shards)}):
        pool.call(name, "release", step, what=f"releasing step {step}")
    metrics["pool/resampled_shards"] = float(resampled)
    return ref, metrics


def publish_weights(cfg: RunConfig, ckpt: CheckpointRef) -> dict[str, float]:
    """After ``ckpt`` is the run's published version: the trainer's weights to every engine, in-pool.

    The trainer's state dict goes through the Ray object store (one ``ray.put``, each engine reads it); on a
    GPU cluster this is the place for the NCCL broadcast of ``unirl_core.train.weight_sync`` (trainer rank 0
    -> engine ranks). An engine that already serves ``ckpt`` is skipped (nothing is published twice). A dead
    actor or a trainer holding another version is not an error here: the version is in the store, and an
    engine that missed it loads it from there before its next rollout."""
    pool = Pool.get(cfg)
    t0 = time.perf_counter()
    want = (ckpt.uri, ckpt.policy_version)
    pushed = 0
    try:
        stale = [engine_name(i) for i in range(cfg.pool.num_engines)
                 if tuple(pool.call(engine_name(i), "served_version", what="publish") or ()) != want]
        weights = pool.call(TRAINER, "weights", ckpt, what=f"publish v{ckpt.policy_version}") if stale else []
        if weights:
            pending = [(name, pool.actor(name).load_weights.remote(weights[0], ckpt)) for name in stale]
            for name, r in pending:
                pool.wait(name, r, what=f"publish v{ckpt.policy_version}")
                pushed += 1
    except PoolActorDied as e:
        log.warning("pool: in-pool publication of %s skipped (%s); engines load it from the store", ckpt.uri, e)
    return {"pool/engines_pushed": float(pushed), "pool/publish_s": time.perf_counter() - t0}
