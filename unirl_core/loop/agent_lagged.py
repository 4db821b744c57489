"""Agentic rollouts under a lag (``lm.agent`` with ``async_training.max_policy_lag >= 1``): turn-boundary suspension.

``LaggedRollouts`` launches each agentic request through ``agentic_rollout`` on its sampler thread, with the
manager's ``TurnGate``: a quiesce (eval; with ``resume_version: latest`` every publication) parks the batch at its
next turn boundary, ``resume()`` reloads weights and continues; ``lm.agent.switch_at_turn: t`` (``pinned``) samples
turns >= t with version ``v + 1`` (reproducible; ``latest`` depends on timing). Every turn's version is recorded in
``agent.turn_versions``; the Part's ``policy_version`` is the oldest. Details: ``docs/engines.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.run import RunConfig
from unirl_core.runtime import build
from unirl_core.loop.executors import in_process
from unirl_core.loop.phases import sample_step
from unirl_core.rollout.manager import RolloutRequest
from unirl_core.rollout.turn_gate import TurnGate
from unirl_core.runtime.steps import token_rates
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)


def suspends_turns(cfg: RunConfig) -> bool:
    """True when lagged rollouts of ``cfg`` are agentic (they park at turn boundaries on quiesce)."""
    return cfg.family == "lm" and cfg.lm.agent is not None and cfg.async_training.max_policy_lag > 0


class LaggedTurns:
    """The ``TurnHook`` of one lagged agentic request (see the module docstring)."""

    def __init__(self, cfg: RunConfig, req: RolloutRequest, policy, gate: TurnGate,
                 ref_of: Callable[[int], CheckpointRef], available: Callable[[], int]) -> None:
        self.cfg, self.req, self.policy, self.gate = cfg, req, policy, gate
        self.ref_of, self.available = ref_of, available
        self.version = req.policy_version
        agent = cfg.lm.agent
        self.switch = agent.switch_at_turn if req.policy_version + 1 <= req.step - 1 else None
        self.resume_version = agent.resume_version
        self.wait_s = 0.0

    def pinned_version(self, turn: int) -> int:
        return self.req.policy_version + (self.switch is not None and turn >= self.switch)

    def pause_before(self, turn: int) -> bool:
        return self.gate.closed or (self.switch is not None and turn == self.switch)

    def pause(self, turn: int) -> int:
        t0 = time.perf_counter()
        if self.resume_version == "pinned":
            want = self.pinned_version(turn)
            self.gate.park(until=lambda: self.available() >= want)
        else:
            self.gate.park()
            want = max(self.version, min(self.available(), self.req.step - 1))
        self.wait_s += time.perf_counter() - t0
        ref = self.ref_of(want)
        # always reload: while parked the driver may have loaded other weights into the shared rollout model
        build.load_policy_weights(self.policy, ref, self.cfg)
        if want != self.version:
            log.info("rollout step %d shard %d: turns from %d sample with version %d (was %d)", self.req.step,
                     self.req.shard, turn, want, self.version)
        self.version = want
        return ref.policy_version


def agentic_rollout(cfg: RunConfig, req: RolloutRequest, *, gate: TurnGate, ref_of: Callable[[int], CheckpointRef],
                    available: Callable[[], int]) -> tuple[SampleBatch, dict[str, float]]:
    """One lagged agentic request on the sampler thread: parks first while the gate is closed, then samples with
    ``req.policy_version`` and lets ``LaggedTurns`` suspend and switch at turn boundaries."""
    gate.enter()
    try:
        t0 = time.perf_counter()
        ref = ref_of(req.policy_version)
        resources = in_process().resources  # the sampler thread's rollout bundle is the in-process executor's
        policy = resources.bundle(cfg)
        build.load_policy_weights(policy, ref, cfg)
        hook = LaggedTurns(cfg, req, policy, gate, ref_of, available)
        batch, metrics = sample_step(cfg, policy, ref, step=req.step, shard=req.shard,
                                     num_shards=cfg.loop.rollout_shards, weights="policy", started=t0, turn_hook=hook,
                                     resources=resources)
        busy = max(metrics["rollout/seconds"] - hook.wait_s, 1e-9)
        metrics.update({"rollout/seconds": busy, "rollout/agent_suspend_wait_s": hook.wait_s,
                        **token_rates(batch, busy)})
        return batch, metrics
    finally:
        gate.leave()
