"""The pool's actors as plain classes; ``unirl_core.pool.cluster`` wraps them with ``ray.remote``.

Each runs in its own Ray worker process and keeps its state between calls: the engine its rollout bundle
(and the full batches it sampled, in the object store), the trainer its TrainBackend with the optimizer
state, the reward actor its scorers. Every method takes and returns the library's own types.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch

from unirl_core.checkpoint import CheckpointRef, restore_train_checkpoint, save_train_checkpoint
from unirl_core.config.loader import to_dict
from unirl_core.config.run import RunConfig
from unirl_core.loop import build, phases
from unirl_core.pool.config import Emit
from unirl_core.pool.projection import for_training, project
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

Version = tuple[str, int]
"""(checkpoint URI, policy version): the identity of a set of weights inside the pool."""


def _version(ckpt: CheckpointRef) -> Version:
    return ckpt.uri, ckpt.policy_version


class _Actor:
    def __init__(self, cfg: RunConfig, name: str, threads: int) -> None:
        # Ray sets OMP_NUM_THREADS from num_cpus only when unset; set torch's pool explicitly so a CPU actor
        # computes with the thread count it reserved (thread counts can change a reduction's bits).
        torch.set_num_threads(threads)
        self.cfg, self.name = cfg, name

    def pid(self) -> int:
        """The worker process id (tests kill it to simulate a lost node)."""
        return os.getpid()


class EngineActor(_Actor):
    """The rollout bundle and the trainside engine; holds one set of weights, labelled by version."""

    def __init__(self, cfg: RunConfig, name: str, threads: int) -> None:
        super().__init__(cfg, name, threads)
        self.policy = build.bundle(cfg)
        self.served: Version | None = None
        self._batches: dict[tuple[int, int], object] = {}  # (step, shard) -> ObjectRef of the full batch

    def served_version(self) -> Version | None:
        return self.served

    def load_weights(self, weights: dict[str, torch.Tensor], ckpt: CheckpointRef) -> float:
        """In-pool publication: the trainer's trainable (or full) state dict of version ``ckpt``; returns the
        seconds it took. Rounded into the bundle's dtype on copy, exactly as a load from the store."""
        t0 = time.perf_counter()
        build.apply_policy_weights(self.policy, weights, where=f"{self.name} <- trainer ({ckpt.uri})")
        self.served = _version(ckpt)
        return time.perf_counter() - t0

    def rollout(self, ckpt: CheckpointRef, step: int, shard: int, num_shards: int,
                emit: Emit) -> tuple[SampleBatch, dict[str, float]]:
        """Sample one shard with ``ckpt``'s weights (from the store when the pool has not published them here,
        e.g. after a restart); keeps the full batch in the object store for the trainer."""
        import ray

        t0 = time.perf_counter()
        from_store = self.served != _version(ckpt)
        if from_store:
            self.served = None
            build.load_policy_weights(self.policy, ckpt, self.cfg)
            self.served = _version(ckpt)
        batch, metrics = phases.sample_step(self.cfg, self.policy, ckpt, step=step, shard=shard,
                                            num_shards=num_shards, weights="policy", started=t0)
        self._batches = {k: v for k, v in self._batches.items() if k[0] >= step}
        self._batches[(step, shard)] = ray.put(batch)  # owned by this actor: lives as long as it holds it
        metrics["pool/weights_from_store"] = float(from_store)
        return (batch if emit == "full" else project(batch)), metrics

    def batch_ref(self, step: int, shard: int) -> list:
        """``[ObjectRef]`` of the full batch of (step, shard), or ``[]`` when this engine does not hold it."""
        ref = self._batches.get((step, shard))
        return [] if ref is None else [ref]

    def release(self, step: int) -> None:
        """Drop the full batches of steps up to ``step`` (the trainer has consumed them)."""
        self._batches = {k: v for k, v in self._batches.items() if k[0] > step}


class TrainerActor(_Actor):
    """The TrainBackend with its optimizer state resident; restores from the store only when its state is not
    the version it is asked to train from (first call, a restarted actor, a retried step)."""

    def __init__(self, cfg: RunConfig, name: str, threads: int) -> None:
        super().__init__(cfg, name, threads)
        self.backend = build.trainer(cfg)
        self.state: Version | None = None  # the version the resident state equals, None before a restore
        self.extra: dict[str, object] = {}

    def train(self, ckpt: CheckpointRef, step: int, scored: SampleBatch,
              *shards: SampleBatch) -> tuple[CheckpointRef, dict[str, float]]:
        """Train the full ``shards`` of step ``step`` with ``scored``'s advantages; writes (unpublished)
        version ``step`` to the store, as the pods train phase does."""
        cfg, backend = self.cfg, self.backend
        restored = self.state != _version(ckpt) or backend.step_count != ckpt.step
        if restored:
            self.state = None
            loaded = restore_train_checkpoint(backend, ckpt, storage_options=cfg.checkpoint.storage_options)
            self.state, self.extra = _version(ckpt), dict(loaded.extra)
        batch = for_training(SampleBatch.concat(list(shards)), scored)
        phases.check_policy_lag(cfg, batch, ckpt)
        self.state = None  # from here on the resident state is no version until it is saved
        metrics = backend.step(batch).as_dict()
        extra = dict(self.extra)
        if phases.TRACKER_KEY in batch.metadata:
            extra["tracker"] = json.loads(batch.metadata[phases.TRACKER_KEY])
        ref = save_train_checkpoint(build.store(cfg), backend, config=to_dict(cfg), extra=extra, publish=False,
                                    overwrite=True)
        self.state, self.extra = _version(ref), extra
        out = {f"train/{k}": float(v) for k, v in metrics.items()}
        out["pool/trainer_restored"] = float(restored)
        return ref, out

    def weights(self, ckpt: CheckpointRef) -> list:
        """``[ObjectRef]`` of the state dict of version ``ckpt`` (``model_state_dict``), or ``[]`` when the
        resident state is another version (then engines load ``ckpt`` from the store)."""
        import ray

        if self.state != _version(ckpt):
            return []
        return [ray.put(self.backend.model_state_dict())]


class RewardActor(_Actor):
    """The RewardService (scorers loaded once)."""

    def __init__(self, cfg: RunConfig, name: str, threads: int) -> None:
        super().__init__(cfg, name, threads)
        self.service = build.reward_service(cfg)

    def score(self, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
        scored, stats = self.service.score_with_stats(batch)
        return scored, stats.as_metrics()
