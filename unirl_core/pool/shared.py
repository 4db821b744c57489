"""``pool.placement: shared``: one actor process hosts the trainer and the trainside engine.

The engine samples with the trainer's own module inside the policy's compute context: the fp32 masters read as
casts to the model dtype, the rounding a load of the published version gives, so the first update's ratio is
exactly 1 with one copy of the weights and no publication transfer. What the two roles share (module mode, RNG,
EMA swaps, memory, the version held) and what is refused: ``docs/execution.md`` ("Shared placement").
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Literal

import torch

from unirl_core.checkpoint import CheckpointRef
from unirl_core.errors import ConfigError, field_error
from unirl_core.runtime import steps
from unirl_core.pool.actors import TrainerActor
from unirl_core.config.pool import Emit
from unirl_core.pool.projection import project
from unirl_core.types import SampleBatch

SHARED = "shared"
"""Actor name of the trainer + engine process."""


class SharedActor(TrainerActor):
    """A ``TrainerActor`` (one rank, optimizer resident) that also answers the engine's calls: ``rollout`` samples
    with the trainer's module, the full batches stay in this process until ``train`` consumes them."""

    def __init__(self, cfg, name: str, threads: int) -> None:
        super().__init__(cfg, name, threads)
        self._held: dict[tuple[int, int], SampleBatch] = {}  # (step, shard) -> full batch, until trained
        self._held_lock = threading.Lock()  # release runs in the query group's thread
        self._restored = False  # the state was restored since the last train call (reported by train)

    def served_version(self) -> tuple[str, int] | None:
        """The version the engine samples with: the trainer's resident one (None while none is)."""
        return self.state

    def rollout(self, ckpt: CheckpointRef, step: int, shard: int, num_shards: int, emit: Emit,
                weights: Literal["policy", "ema"] = "policy") -> tuple[SampleBatch, dict[str, float]]:
        """Sample one shard with the trainer's module holding ``ckpt`` (its EMA weights with ``weights='ema'``);
        keeps the full batch here for ``train`` and returns the projection (``emit``) and the metrics."""
        t0 = time.perf_counter()
        restored = self._hold(ckpt)
        self._restored = self._restored or restored
        backend = self.backend
        if weights == "ema" and backend.ema is None:
            raise field_error(ConfigError, "train.ema_decay", None, "a decay, to sample with the trainer's EMA",
                              "set train.ema_decay (e.g. 0.9)")
        device = backend.dist.device
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), \
                (backend.ema_applied() if weights == "ema" else nullcontext()):
            batch, metrics = steps.sample_step(self.cfg, backend.policy, ckpt, step=step, shard=shard,
                                                num_shards=num_shards, weights=weights, started=t0,
                                                resources=self.resources)
        with self._held_lock:  # older steps were trained or dropped
            self._held = {k: v for k, v in self._held.items() if k[0] >= step}
            self._held[(step, shard)] = batch
        metrics["pool/weights_from_store"] = float(restored)
        metrics["pool/shared"] = 1.0
        return (batch if emit == "full" else project(batch)), metrics

    def batch_ref(self, step: int, shard: int) -> list | None:
        """``[]`` when this process holds the full batch of (step, shard) (``train`` takes it here: none travels),
        None when it does not (sampled before a restart, or served from a task cache): the driver has it sampled
        again before ``train``."""
        with self._held_lock:
            return [] if (step, shard) in self._held else None

    def _train(self, ckpt: CheckpointRef, step: int, scored: SampleBatch, shards: tuple[SampleBatch, ...], *,
               background: bool) -> tuple[CheckpointRef, dict[str, float]]:
        """``TrainerActor.train`` (``train_background``) on the full batches this process sampled for ``step``
        (none travel)."""
        if not shards:
            num = self.cfg.loop.rollout_shards
            missing = [s for s in range(num) if self.batch_ref(step, s) is None]
            if missing:
                raise field_error(ConfigError, f"{self.name}: train step {step}", f"shards {missing} missing",
                                  "the full batches of every shard of the step", "sample them first (the pool's "
                                  "train phase does)")
            with self._held_lock:
                shards = tuple(self._held.pop((step, s)) for s in range(num))
        restored, self._restored = self._restored, False
        ref, metrics = super()._train(ckpt, step, scored, shards, background=background)
        metrics["pool/trainer_restored"] = max(metrics["pool/trainer_restored"], float(restored))
        return ref, metrics

    def release(self, step: int) -> None:
        """Drop the full batches of steps up to ``step``."""
        with self._held_lock:
            self._held = {k: v for k, v in self._held.items() if k[0] > step}
