"""The pool executor: the phases run on the run's Ray actors (``unirl_core.pool.phases``); this process keeps only
the version the trainer actor is writing in the background.

Trajectory tensors stay in the pool; what comes back is the projection (``pool.emit``). Advantages are computed
here, on the projection, with the same function the in-process executor uses.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.run import RunConfig
from unirl_core.pool import phases as pool_phases
from unirl_core.pool.cluster import Pool
from unirl_core.runtime import build
from unirl_core.runtime.inprocess import publish_in_store
from unirl_core.runtime.steps import advantage_step
from unirl_core.types import SampleBatch


class PoolExecutor:
    """Rollout, score and train on the pool's actors; publish moves ``LATEST`` and pushes the weights in-pool.

    State it owns: ``pending_write``, the config and ref of the last version the trainer actor was asked to write
    in the background (one trainer rank, ``train(asynchronous=True)``); ``finish_writes`` waits for that write."""

    def __init__(self) -> None:
        self.pending_write: dict[str, object] = {}

    def rollout(self, cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int, num_shards: int,
                weights: Literal["policy", "ema"], gen_round: int = 0,
                trainer_copy: bool = False) -> tuple[SampleBatch, dict[str, float]]:
        """One shard on its engine actor (``trainer_copy`` is the engine actors' own business: they get every
        version from the trainer in-pool; ``gen_round`` is 0: config refuses dynamic sampling in the pool)."""
        return pool_phases.rollout_phase(cfg, ckpt, step=step, shard=shard, num_shards=num_shards, weights=weights)

    def score(self, cfg: RunConfig, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
        return pool_phases.reward_phase(cfg, batch)

    def advantage(self, cfg: RunConfig, batch: SampleBatch,
                  ckpt: CheckpointRef) -> tuple[SampleBatch, dict[str, float]]:
        return advantage_step(cfg, batch, ckpt, before_read=self.finish_writes)

    def train(self, cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *, step: int,
              asynchronous: bool = False) -> tuple[CheckpointRef, dict[str, float]]:
        """Train on the trainer actor (its optimizer state stays resident between steps); with one trainer rank
        and ``asynchronous`` the actor writes the version on its own thread (``finish_writes`` waits for it)."""
        background = asynchronous and cfg.pool.trainer_ranks == 1
        ref, metrics = pool_phases.train_phase(cfg, batch, ckpt, step=step, background=background)
        if background:
            self.pending_write.update(cfg=cfg, ref=ref)
        return ref, metrics

    def publish(self, cfg: RunConfig, ckpt: CheckpointRef, *, asynchronous: bool = False) -> dict:
        """``LATEST`` to ``ckpt`` (by the trainer's writer thread once written, when it is writing it), then the
        trainer's weights to the engines in-pool (``pool/*`` entries) and retention on the trainer actor."""
        if asynchronous and self.pending_write.get("ref") == ckpt and pool_phases.publish_when_written(cfg, ckpt):
            pending = {"uri": ckpt.uri, "step": ckpt.step, "policy_version": ckpt.policy_version, "pending_write": 1}
            if build.store(cfg).encoding.deltas:  # engines read a delta from the store: the version is written first
                t0 = time.perf_counter()
                self.finish_writes()
                pending.update(pending_write=0, **{"pool/delta_wait_written_s": time.perf_counter() - t0})
            return {**pending, **pool_phases.publish_weights(cfg, ckpt)}  # in-pool: from the trainer's memory
        self.finish_writes()
        published = publish_in_store(cfg, ckpt, retention=False)  # the trainer actor deletes old versions
        published.update(pool_phases.publish_weights(cfg, ckpt))
        pool_phases.prune_versions(cfg)
        return published

    def rollout_workers(self, cfg: RunConfig) -> EngineActors:
        """The pool's engine actors (Ray and the actors start now, on the caller's thread)."""
        Pool.get(cfg)
        return EngineActors(cfg.pool.call_timeout_s)

    def finish_writes(self) -> None:
        """Wait for the trainer actor's background write (and its publish); raises its failure."""
        if self.pending_write:
            cfg, ref = self.pending_write.pop("cfg"), self.pending_write.pop("ref")
            pool_phases.wait_written(cfg, ref)


@dataclass(frozen=True)
class EngineActors:
    """Rollouts on the pool's engine actors, which receive every published version in-pool; each call is bounded
    by ``pool.call_timeout_s``."""

    call_timeout_s: float

    def submit(self, cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int, num_shards: int) -> Future:
        return pool_phases.submit_rollout(cfg, ckpt, step=step, shard=shard, num_shards=num_shards)
