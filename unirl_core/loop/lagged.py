"""The driver's rollout sources: where ``run_local`` gets each step's rollouts, for any
``async_training.max_policy_lag: k``.

Step ``n`` trains from version ``n - 1`` and its rollout samples with version ``rollout_version(cfg, n) =
max(0, n - 1 - k)`` (``AsyncTrainingConfig.rollout_version``). ``rollout_source`` picks the source for ``k``; the
driver makes the same calls on either (``RolloutSource``), so synchronous training is the lag-0 case of one loop:

- ``k = 0``: ``SyncRollouts`` samples step ``n`` at ``take(n)`` with version ``n - 1``, the trainer's own copy
  (nothing runs beside the driver, so the version is written in the background while the next rollout samples);
- ``k > 0``: ``LaggedRollouts``, the rollout manager with a worker thread, or inline; in pool mode it dispatches to
  the pool's engine actors, which sample while the trainer actor trains.

The Flyte workflow wires the same rule as a dependency: rollout ``n`` waits for the publication of version
``n - 1 - k``, not for train ``n - 1``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, field_error
from unirl_core.runtime import build
from unirl_core.loop.agent_lagged import agentic_rollout, suspends_turns
from unirl_core.loop.executors import executor_for, in_process
from unirl_core.loop.phases import rollout_phase
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.rollout.manager import ManagerConfig, RolloutManager, RolloutRequest, check_batch_provenance
from unirl_core.rollout.partial import continue_generation
from unirl_core.rollout.turn_gate import TurnGate
from unirl_core.runtime.steps import token_rates
from unirl_core.sde.noise import stable_seed
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)


def lagged_checkpoint(cfg: RunConfig, ckpt: CheckpointRef, version: int) -> CheckpointRef:
    """The run's version ``version`` (``ckpt`` itself when it is that version), read from the store."""
    if version == ckpt.step:
        return ckpt
    for ref in build.store(cfg).versions():
        if ref.step == version:
            return ref
    raise field_error(CheckpointError, "checkpoint.keep_last", cfg.checkpoint.keep_last,
                      f"version {version} of run {cfg.name!r} kept for a rollout lagging "
                      f"{cfg.async_training.max_policy_lag} versions ({build.store(cfg).uri} has none)",
                      "raise checkpoint.keep_last to at least max_policy_lag + 1, or resume with a smaller lag")


class _Inline:
    """An executor that runs the work at submit (overlap off): same numbers, no concurrency."""

    def submit(self, fn, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as exc:  # the manager re-raises it (and stays poisoned)
            fut.set_exception(exc)
        return fut

    def shutdown(self, **_) -> None:
        pass


class RolloutSource:
    """What the driver asks of a rollout source, once per step in this order: ``take``, ``before_publish`` (after
    train), ``mark_available`` (after publish), ``quiesce`` (before an eval), ``published`` (after the step); all
    but ``take`` have nothing to do here."""

    background_writes: bool = False
    """True when nothing reads the store before the next train phase: versions are written in the background (a
    source opts in; the safe default writes each version before the step ends)."""

    def take(self, step: int) -> tuple[list[SampleBatch], list[dict[str, float]], dict[str, float]]:
        raise NotImplementedError

    def before_publish(self) -> dict[str, float]:
        return {}

    def mark_available(self, ckpt: CheckpointRef) -> None:
        pass

    def quiesce(self) -> None:
        pass

    def published(self, ckpt: CheckpointRef) -> None:
        pass

    def close(self) -> None:
        pass


def rollout_source(cfg: RunConfig, ckpt: CheckpointRef) -> RolloutSource:
    """The rollout source of a run resumed at ``ckpt``: lagged under ``async_training.max_policy_lag`` > 0 (when
    steps remain), else the step's own."""
    if cfg.async_training.max_policy_lag and ckpt.step < cfg.loop.total_steps:
        return LaggedRollouts(cfg, ckpt)
    return SyncRollouts(cfg, ckpt)


class SyncRollouts(RolloutSource):
    """Lag 0: ``take(n)`` samples every shard of step ``n`` with the version the step trains from, the trainer's
    copy of it (``rollout_phase(trainer_copy=True)``)."""

    background_writes = True  # nothing reads the store before the next train phase

    def __init__(self, cfg: RunConfig, ckpt: CheckpointRef) -> None:
        self.cfg, self._ckpt = cfg, ckpt

    def take(self, step: int) -> tuple[list[SampleBatch], list[dict[str, float]], dict[str, float]]:
        shards, ckpt = self.cfg.loop.rollout_shards, self._ckpt
        got = [rollout_phase(self.cfg, ckpt, step=step, shard=s, num_shards=shards, trainer_copy=True)
               for s in range(shards)]
        return [b for b, _ in got], [m for _, m in got], {}

    def mark_available(self, ckpt: CheckpointRef) -> None:
        self._ckpt = ckpt


class LaggedRollouts(RolloutSource):
    """``run_local``'s rollout source under a lag: a ``RolloutManager`` over ``rollout_phase`` (pinned versions).

    ``take(step)`` returns the step's shard batches, their metrics and ``async/*`` metrics; ``published(ckpt)``
    after every publication lets the manager dispatch what the new version admits (and resumes a ``quiesce``).

    With the executor's own rollout workers (``Executor.rollout_workers``: the pool's engine actors): no thread; each
    request is a worker call, so rollout ``n + 1`` runs on the engines while the trainer actor trains ``n``. The
    workers receive every published version, so ``quiesce()`` drains them before the publish
    (``quiesce_before_publish``)."""

    def __init__(self, cfg: RunConfig, ckpt: CheckpointRef) -> None:
        a = cfg.async_training
        shards = cfg.loop.rollout_shards
        self.cfg = cfg
        # the executor's own rollout workers (the pool's engine actors), started on this (the driver's) thread
        # before any dispatch; None: the rollouts sample in this process
        self.workers = executor_for(cfg).rollout_workers(cfg)
        self._refs: dict[int, CheckpointRef] = {ckpt.step: ckpt}
        self._start = ckpt
        self._quiesced = False
        # a worker call is bounded; the manager's futures by the same bound on each wait
        self._timeout = self.workers.call_timeout_s if self.workers is not None else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout") \
            if a.overlap and self.workers is None else _Inline()
        config = ManagerConfig(max_policy_lag=a.max_policy_lag, num_shards=shards,
                               max_inflight=a.max_inflight or shards * (a.max_policy_lag + 1),
                               last_step=cfg.loop.total_steps)
        # agentic rollouts park at turn boundaries on quiesce (unirl_core/loop/agent_lagged.py)
        self.gate = TurnGate() if suspends_turns(cfg) else None
        self.manager = RolloutManager(config, self._launch, check=self._check, first_step=ckpt.step + 1,
                                      published=ckpt.step, gate=self.gate)
        self._last_take: float | None = None
        self._available = ckpt.step  # newest published version (a partial rollout waits for the next one)
        self._version_cond = threading.Condition()
        self._closing = False

    def _ref(self, version: int) -> CheckpointRef:
        if version not in self._refs:
            self._refs[version] = lagged_checkpoint(self.cfg, self._start, version)
        return self._refs[version]


    @property
    def quiesce_before_publish(self) -> bool:
        """True when a publication changes the weights in-flight rollouts sample with (the pool's engines)."""
        return self.workers is not None or (self.gate is not None and self.cfg.lm.agent.resume_version == "latest")

    def before_publish(self) -> dict[str, float]:
        """Drain in-flight rollouts when the publication changes their weights (the pool: the engines get the new
        version); returns the time it took as ``async/publish_quiesce_s``."""
        if not self.quiesce_before_publish:
            return {}
        t0 = time.perf_counter()
        self.quiesce()
        return {"async/publish_quiesce_s": time.perf_counter() - t0}

    def quiesce(self) -> None:
        """Pause dispatch and drain in-flight rollouts (before a publish into the engines, or an eval that loads
        weights into the sampler's model); the next ``published`` resumes."""
        self.manager.quiesce(timeout=self._timeout)
        self._quiesced = True

    def _launch(self, req: RolloutRequest) -> Future:
        if self.gate is not None:
            return self._executor.submit(agentic_rollout, self.cfg, req, gate=self.gate, ref_of=self._ref,
                                         available=lambda: self._available)
        ref = self._ref(req.policy_version)
        if self.workers is not None:
            fut = self.workers.submit(self.cfg, ref, step=req.step, shard=req.shard,
                                      num_shards=self.cfg.loop.rollout_shards)
            if not self.cfg.async_training.overlap:
                wait([fut])  # inline: the same numbers, nothing runs beside the driver
            return fut
        # the continuation samples with the next version, which must be one the step may train on (warm-up steps
        # whose version is clamped to 0 have none: they sample whole completions)
        if self.cfg.async_training.partial_rollout is not None and req.policy_version + 1 <= req.step - 1:
            return self._executor.submit(self._partial_rollout, req, ref)
        return self._executor.submit(rollout_phase, self.cfg, ref, step=req.step, shard=req.shard,
                                     num_shards=self.cfg.loop.rollout_shards)

    def _partial_rollout(self, req: RolloutRequest, ref: CheckpointRef) -> tuple[SampleBatch, dict[str, float]]:
        """Sample ``interrupt_at_tokens`` tokens with ``ref``, wait for the next version's publication, continue
        the running completions with it (``unirl_core/rollout/partial.py``). Runs on the sampler thread."""
        cfg, partial = self.cfg, self.cfg.async_training.partial_rollout
        t0 = time.perf_counter()
        head = dataclasses.replace(cfg, async_training=dataclasses.replace(cfg.async_training, partial_rollout=None),
                                   lm=dataclasses.replace(cfg.lm, sampling=dataclasses.replace(
                                       cfg.lm.sampling, max_new_tokens=partial.interrupt_at_tokens)))
        batch, metrics = rollout_phase(head, ref, step=req.step, shard=req.shard, num_shards=cfg.loop.rollout_shards)
        first_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self._wait_for(req.policy_version + 1)
        waited = time.perf_counter() - t1
        newer = self._ref(req.policy_version + 1)
        policy = in_process().resources.bundle(cfg)  # lagged rollouts without a pool sample in this process
        build.load_policy_weights(policy, newer, cfg)
        seed = stable_seed(cfg.loop.seed, "rollout", req.step, req.shard, "continue") % (2**63)
        engine = TrainsideAREngine(policy, dataclasses.replace(cfg.lm.engine, seed=seed,
                                                               micro_batch_tokens=cfg.train.micro_batch_tokens),
                                   policy_version=ref.policy_version)
        gen = torch.Generator(device=next(policy.module.parameters()).device).manual_seed(seed)
        batch, more = continue_generation(engine, batch, max_new_tokens=cfg.lm.sampling.max_new_tokens, generator=gen,
                                          old_tokens=partial.old_tokens)
        busy = first_s + time.perf_counter() - t1 - waited
        metrics.update(more)
        metrics.update({"rollout/seconds": busy, "rollout/partial_wait_s": waited, **token_rates(batch, busy)})
        return batch, metrics

    def _wait_for(self, version: int) -> None:
        with self._version_cond:
            while self._available < version:
                if self._closing:
                    raise RuntimeError(f"lagged rollouts closed while a partial rollout waited for version {version}")
                self._version_cond.wait(timeout=1.0)

    def mark_available(self, ckpt: CheckpointRef) -> None:
        """Version ``ckpt`` is published: a partial rollout waiting for it continues (no new dispatch yet)."""
        self._refs[ckpt.step] = ckpt
        with self._version_cond:
            self._available = max(self._available, ckpt.step)
            self._version_cond.notify_all()
        if self.gate is not None:
            self.gate.notify()  # an agentic rollout may wait for this version at a turn boundary

    def _check(self, req: RolloutRequest, result: tuple[SampleBatch, dict]) -> None:
        ref = self._ref(req.policy_version)
        check_batch_provenance(RolloutRequest(step=req.step, shard=req.shard, policy_version=ref.policy_version),
                               result[0])

    def take(self, step: int) -> tuple[list[SampleBatch], list[dict[str, float]], dict[str, float]]:
        got = self.manager.take(step, timeout=self._timeout)
        metrics = got.metrics(self.cfg.async_training.max_policy_lag)
        now = time.perf_counter()
        if self._last_take is not None and self.cfg.async_training.overlap:
            # the sampler's share of the interval between two takes it spent not sampling (steady state: one
            # step's rollout per interval)
            busy = sum(r[1].get("rollout/seconds", 0.0) for r in got.results)
            metrics["async/engine_idle_frac"] = max(0.0, 1.0 - busy / max(now - self._last_take, 1e-9))
        self._last_take = now
        return [r[0] for r in got.results], [r[1] for r in got.results], metrics

    def published(self, ckpt: CheckpointRef) -> None:
        self.mark_available(ckpt)
        for old in [v for v in self._refs if v < ckpt.step - self.cfg.async_training.max_policy_lag]:
            del self._refs[old]
        self.manager.publish(ckpt.step)
        if self._quiesced:  # after the version is recorded: what resume dispatches samples with it
            self._quiesced = False
            self.manager.resume()

    def close(self) -> None:
        with self._version_cond:
            self._closing = True
            self._version_cond.notify_all()
        if self.gate is not None:
            self.gate.shutdown()
        self.manager.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
