"""Lagged (asynchronous) rollouts for the loop: ``async_training.max_policy_lag: k`` > 0.

Step ``n`` trains from version ``n - 1`` and its rollout samples with version ``rollout_version(cfg, n) =
max(0, n - 1 - k)`` (``AsyncTrainingConfig.rollout_version``). ``run_local`` gets its rollouts through
``LaggedRollouts`` (the rollout manager with a worker thread, or inline); the Flyte workflow wires the same rule as
a dependency: rollout ``n`` waits for the publication of version ``n - 1 - k``, not for train ``n - 1``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, field_error
from unirl_core.loop import build
from unirl_core.loop.phases import rollout_phase
from unirl_core.rollout.manager import ManagerConfig, RolloutManager, RolloutRequest, check_batch_provenance
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


class LaggedRollouts:
    """``run_local``'s rollout source under a lag: a ``RolloutManager`` over ``rollout_phase`` (pinned versions).

    ``take(step)`` returns the step's shard batches, their metrics and ``async/*`` metrics; ``published(ckpt)``
    after every publication lets the manager dispatch what the new version admits."""

    def __init__(self, cfg: RunConfig, ckpt: CheckpointRef) -> None:
        a = cfg.async_training
        shards = cfg.loop.rollout_shards
        self.cfg = cfg
        self._refs: dict[int, CheckpointRef] = {ckpt.step: ckpt}
        self._start = ckpt
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout") if a.overlap else _Inline()
        config = ManagerConfig(max_policy_lag=a.max_policy_lag, num_shards=shards,
                               max_inflight=a.max_inflight or shards * (a.max_policy_lag + 1))
        self.manager = RolloutManager(config, self._launch, check=self._check, first_step=ckpt.step + 1,
                                      published=ckpt.step)
        self._last_take: float | None = None

    def _ref(self, version: int) -> CheckpointRef:
        if version not in self._refs:
            self._refs[version] = lagged_checkpoint(self.cfg, self._start, version)
        return self._refs[version]

    def _launch(self, req: RolloutRequest) -> Future:
        ref = self._ref(req.policy_version)
        return self._executor.submit(rollout_phase, self.cfg, ref, step=req.step, shard=req.shard,
                                     num_shards=self.cfg.loop.rollout_shards)

    def _check(self, req: RolloutRequest, result: tuple[SampleBatch, dict]) -> None:
        ref = self._ref(req.policy_version)
        check_batch_provenance(RolloutRequest(step=req.step, shard=req.shard, policy_version=ref.policy_version),
                               result[0])

    def take(self, step: int) -> tuple[list[SampleBatch], list[dict[str, float]], dict[str, float]]:
        got = self.manager.take(step)
        metrics = got.metrics()
        now = time.perf_counter()
        if self._last_take is not None and self.cfg.async_training.overlap:
            # the sampler's share of the interval between two takes it spent not sampling (steady state: one
            # step's rollout per interval)
            busy = sum(r[1].get("rollout/seconds", 0.0) for r in got.results)
            metrics["async/engine_idle_frac"] = max(0.0, 1.0 - busy / max(now - self._last_take, 1e-9))
        self._last_take = now
        return [r[0] for r in got.results], [r[1] for r in got.results], metrics

    def published(self, ckpt: CheckpointRef) -> None:
        self._refs[ckpt.step] = ckpt
        for old in [v for v in self._refs if v < ckpt.step - self.cfg.async_training.max_policy_lag]:
            del self._refs[old]
        self.manager.publish(ckpt.step)

    def close(self) -> None:
        self.manager.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
