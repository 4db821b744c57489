"""``pool.placement: shared``: one actor process hosts the trainer and the trainside engine.

The engine samples with the trainer's own module (``TrainBackend.policy``) inside the policy's compute context
(``unirl_core.models.precision``): the trainer keeps fp32 master weights and every forward - the engine's decode,
the trainer's replay of pi_old and its loss forward - reads them cast to the model dtype. That cast rounds exactly
as loading a published fp32 version into a model-dtype rollout bundle does, so the engine samples the bits a
published version would give and the first update's ratio is exactly 1, with one copy of the weights in memory
and no publication transfer (a publish records the version; ``pool/publish_bytes`` is 0).

What the two roles share and what they keep apart:

- the module: the trainside engines switch it to eval mode for sampling and back, and run under ``no_grad``;
  gradient checkpointing is inactive there (transformers checkpoints only layers whose ``training`` flag the
  trainer raises for its grad-enabled forwards; diffusers only with grad enabled);
- the RNG: sampling draws from explicit generators seeded per step and shard; the global RNG state the trainer
  checkpoints is forked around it anyway, so a rollout here leaves it as a rollout in another process would;
- EMA rollouts (``old_policy: ema``): the trainer's EMA shadow is swapped into the module for the rollout
  (``TrainBackend.ema_applied``), the values a load of the version's EMA weights gives;
- memory: the engine holds no weights; its KV cache and activations are freed when a rollout returns and the
  process's one CUDA caching allocator hands those blocks to the train step;
- the version: the module always holds the trainer's current state, so a rollout of another version restores
  that version's full state first (after a restart or a retried step), exactly what the next train call would
  do; a lagged rollout (an older version beside a newer trainer) is refused by config.
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
