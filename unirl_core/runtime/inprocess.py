"""The in-process executor: the phases run in this process, which owns the rollout bundle, the trainer and the
background version writer - as attributes of one ``InProcessExecutor``, never module globals.

``run_local`` and the pods-mode Flyte tasks use it (a task pod's executor starts empty and restores what it needs
from the version it is given; within one process the trainer stays resident between steps).
"""

from __future__ import annotations

import contextlib
import time
from typing import Literal

import torch.distributed

from unirl_core.checkpoint import CheckpointRef, load_manifest
from unirl_core.checkpoint.writer import VersionWriter
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError
from unirl_core.runtime import build
from unirl_core.runtime.resources import Resources
from unirl_core.runtime.steps import advantage_step, restore_full_state, sample_step, train_and_save
from unirl_core.train.backend import TrainBackend
from unirl_core.train.distributed import current_world
from unirl_core.types import SampleBatch


class InProcessExecutor:
    """Rollout, score, advantage, train and publish in this process.

    State it owns:
    - ``resources``: the rollout bundle, the trainer and a dedicated engine (``runtime.resources``);
    - ``writer``: the background version writer (``train(asynchronous=True)``), at most one version in flight;
    - ``resident``: the version the trainer's state equals (the one its last train wrote: ref and the checksums of
      its manifest, None while the writer writes it) and that version's extra JSON. A train from exactly that
      version skips the restore (a read of weights and optimizer state it already holds), as the pool's trainer
      actor does; ``finish_writes`` fills in the checksums of a version the writer finished (or clears the record
      when the write failed).
    """

    def __init__(self) -> None:
        self.writer = VersionWriter()
        self.resident: dict[str, object] = {}
        self.resources = Resources()

    def rollout_workers(self, cfg: RunConfig) -> None:
        """None: rollouts sample in this process (``resources.bundle``)."""
        return None

    # -- rollout -------------------------------------------------------------------------------------------------
    def rollout(self, cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int, num_shards: int,
                weights: Literal["policy", "ema"], gen_round: int = 0,
                trainer_copy: bool = False) -> tuple[SampleBatch, dict[str, float]]:
        """Sample one shard with ``ckpt``'s weights in its rollout bundle (``resources.bundle``), or with
        ``trainer_copy`` from the trainer when it holds exactly ``ckpt`` (see ``loop.phases.rollout_phase``)."""
        t0 = time.perf_counter()
        if trainer_copy and cfg.rollout_with_trainer and current_world()[1] == 1:
            return self._rollout_with_trainer(cfg, ckpt, step=step, shard=shard, num_shards=num_shards,
                                              weights=weights, gen_round=gen_round, started=t0)
        policy = self.resources.bundle(cfg)
        delta = False
        if not (trainer_copy and self._copy_resident_weights(policy, ckpt, cfg, weights)):
            self.finish_writes()  # the version must be in the store before it is read
            delta = build.load_policy_weights(policy, ckpt, cfg, ema=weights == "ema")
        loaded = time.perf_counter() - t0
        batch, metrics = sample_step(cfg, policy, ckpt, step=step, shard=shard, num_shards=num_shards,
                                     weights=weights, started=t0, gen_round=gen_round,
                                     resources=self.resources)
        if delta:  # the version was applied as a delta on the one the bundle held (checkpoint.weights_encoding)
            metrics["rollout/weights_delta"] = 1.0
        return batch, {**metrics, "rollout/load_weights_seconds": loaded}

    def _rollout_with_trainer(self, cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int, num_shards: int,
                              weights: Literal["policy", "ema"], gen_round: int,
                              started: float) -> tuple[SampleBatch, dict[str, float]]:
        """``loop.rollout_with_trainer``: sample with the trainer module holding ``ckpt`` (restored into it first
        when it holds another state: the first step, or after a failed one), inside its compute context, with its
        EMA swapped in for ``weights='ema'``. No rollout bundle is built; the next train finds the trainer resident
        and does not restore again."""
        backend = self.resources.trainer(cfg)
        restored = not self._holds(self.resident, backend, ckpt, cfg)
        if restored:
            self.finish_writes()  # ckpt is read from the store
            self.resident.clear()
            extra = restore_full_state(backend, ckpt, cfg)
            files = load_manifest(ckpt, storage_options=cfg.checkpoint.storage_options).files
            self.resident.update(backend=backend, version=(ckpt.uri, ckpt.step, ckpt.policy_version), files=files,
                                 extra=dict(extra))
        loaded = time.perf_counter() - started
        with backend.ema_applied() if weights == "ema" else contextlib.nullcontext():
            batch, metrics = sample_step(cfg, backend.policy, ckpt, step=step, shard=shard, num_shards=num_shards,
                                         weights=weights, started=started, gen_round=gen_round,
                                         resources=self.resources)
        return batch, {**metrics, "rollout/load_weights_seconds": loaded, "rollout/with_trainer": 1.0,
                       "rollout/trainer_restored": float(restored)}

    def _copy_resident_weights(self, policy, ckpt: CheckpointRef, cfg: RunConfig, weights: str) -> bool:
        """Load ``ckpt``'s policy weights into the rollout bundle from the trainer when it holds exactly that
        version (single rank, trainside sampling); False when the store must be read instead."""
        if weights != "policy" or current_world()[1] > 1 or (cfg.family == "lm" and cfg.lm.dedicated is not None):
            return False
        backend = self.resident.get("backend")
        if not self._holds(self.resident, backend, ckpt, cfg):
            return False
        # device to device: the values model_state_dict() would copy to the host (and the version's file holds),
        # rounded into the rollout dtype by the same copy_; no host round trip of the weights every step
        build.apply_policy_weights(policy, backend.trainable_tensors(), where=f"{ckpt.uri} (the trainer's copy)")
        return True

    # -- reward, advantage ---------------------------------------------------------------------------------------
    def score(self, cfg: RunConfig, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
        """Every sample scored by the run's reward service (built once per process and reward config)."""
        scored, stats = build.reward_service(cfg).score_with_stats(batch)
        return scored, stats.as_metrics()

    def advantage(self, cfg: RunConfig, batch: SampleBatch,
                  ckpt: CheckpointRef) -> tuple[SampleBatch, dict[str, float]]:
        return advantage_step(cfg, batch, ckpt, before_read=self.finish_writes)

    # -- train ---------------------------------------------------------------------------------------------------
    def train(self, cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *, step: int,
              asynchronous: bool = False) -> tuple[CheckpointRef, dict[str, float]]:
        """One rollout batch of updates from ``ckpt``; writes (unpublished) version ``step`` - on the writer's
        thread when ``asynchronous`` and single-rank (see ``loop.phases.train_phase``)."""
        writer = self.writer if asynchronous and current_world()[1] == 1 else None
        if not (writer and self.writer.pending(ckpt)):
            self.finish_writes()  # any other version in flight is complete (or its failure raises) first
        backend = self.resources.trainer(cfg)

        def hold() -> dict:
            extra = self._resident_extra(backend, ckpt, cfg)
            if extra is None:
                self.finish_writes()  # ckpt is read from the store
                extra = restore_full_state(backend, ckpt, cfg)
            return extra

        ref, extra, out = train_and_save(cfg, backend, batch, ckpt, hold=hold, wait=self.finish_writes, writer=writer,
                                         background=writer is not None,
                                         full_state=cfg.checkpoint.full_state_at(step, cfg.loop.total_steps),
                                         memory=self.writer.memory)
        files = None if writer else load_manifest(ref, storage_options=cfg.checkpoint.storage_options).files
        self.resident.update(backend=backend, version=(ref.uri, ref.step, ref.policy_version), files=files,
                             extra=dict(extra))
        return ref, out

    def _resident_extra(self, backend: TrainBackend, ckpt: CheckpointRef, cfg: RunConfig) -> dict | None:
        """``ckpt``'s extra JSON when ``backend`` holds exactly ``ckpt``'s state, else None (restore from the
        store). The manifest is read (not the weights): a version rewritten since, by whoever, has other checksums.
        Cleared first: until this step's version is saved the resident state is no version (a failed step
        restores)."""
        held = dict(self.resident)
        self.resident.clear()
        if self._holds(held, backend, ckpt, cfg):
            return dict(held["extra"])
        return None

    def _holds(self, held: dict, backend: TrainBackend | None, ckpt: CheckpointRef, cfg: RunConfig) -> bool:
        """``held`` (a ``resident`` record) says ``backend`` holds exactly ``ckpt``: same ref, same step, and the
        store's manifest has the checksums it was written with (or the writer is still writing it)."""
        same = (backend is not None and held.get("backend") is backend and backend.step_count == ckpt.step
                and held.get("version") == (ckpt.uri, ckpt.step, ckpt.policy_version))
        if not same:
            return False
        if self.writer.pending(ckpt):
            return True
        if held is self.resident:  # written since, and waited for by someone else (a publish of a finished write)
            self._note_written()
        files = held["files"]
        return files is not None and load_manifest(ckpt, storage_options=cfg.checkpoint.storage_options).files == files

    # -- publish, writes -----------------------------------------------------------------------------------------
    def publish(self, cfg: RunConfig, ckpt: CheckpointRef, *, asynchronous: bool = False) -> dict:
        """Make ``ckpt`` the published version (see ``loop.phases.publish_phase``)."""
        if asynchronous and self.writer.publish(ckpt):
            return {"uri": ckpt.uri, "step": ckpt.step, "policy_version": ckpt.policy_version, "pending_write": 1}
        self.finish_writes()
        return publish_in_store(cfg, ckpt, retention=True)

    def finish_writes(self) -> None:
        """Wait for the version the writer is writing (and its publish) and raise its failure; the resident record
        then gets the checksums the version was written with."""
        try:
            self.writer.wait()
        except CheckpointError:
            self.resident.clear()  # the trainer's state is no version of the store
            raise
        self._note_written()

    def _note_written(self) -> None:
        """The resident record gets the checksums its version was written with, once the writer's wait saw the
        write succeed (``finish_writes``, or the writer's own publish of a write that had finished)."""
        done = self.writer.last_written()
        if done is not None and self.resident.get("files", {}) is None:
            ref, files = done
            if self.resident.get("version") == (ref.uri, ref.step, ref.policy_version):
                self.resident["files"] = files


def publish_in_store(cfg: RunConfig, ckpt: CheckpointRef, *, retention: bool) -> dict:
    """Move the run's ``LATEST`` to ``ckpt`` (rank 0 of a multi-rank job; the others wait) and describe what was
    published from its manifest (no weights read). ``retention``: delete old versions now."""
    rank, world = current_world()
    if rank == 0:
        build.store(cfg).publish(ckpt, retention=retention)
    if world > 1:
        torch.distributed.barrier()
    manifest = load_manifest(ckpt, storage_options=cfg.checkpoint.storage_options)
    return {"uri": ckpt.uri, "step": ckpt.step, "policy_version": ckpt.policy_version,
            "files": {name: dict(info) for name, info in manifest.files.items()},
            "bytes": sum(int(info["bytes"]) for info in manifest.files.values())}
