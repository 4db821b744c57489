"""Agentic rollouts suspended at turn boundaries (lagged runs): per-turn versions, behaviour log-probs of the version
that sampled each turn, stale-turn masking, and the rollout manager's quiesce parking (not draining) a running
rollout while other weights are loaded, after which it continues exactly as an uninterrupted one."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from examples.agentic.guess import GuessNumberEnv, GuessNumberEnvConfig
from unirl_core.env import StepResult, register_env
from unirl_core.errors import InvariantError
from unirl_core.models.lm import build_layout, build_tiny_lm, replay_log_probs
from unirl_core.rollout.agentic import (
    MODEL,
    TURN_VERSIONS_KEY,
    TURNS_KEY,
    AgentConfig,
    AgenticEngine,
)
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.rollout.manager import ManagerConfig, RolloutManager
from unirl_core.rollout.turn_gate import TurnGate
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch

torch.set_num_threads(1)


@dataclass(frozen=True, kw_only=True)
class ProbeEnvConfig:
    """guess_number whose first step (of the process) waits until the test closed the gate: a quiesce lands
    while a turn is in flight."""

    name: Literal["probe_guess_env"] = field(default="probe_guess_env", init=False)


class ProbeEnv(GuessNumberEnv):
    stepped = threading.Event()
    gate_closed = threading.Event()

    def __init__(self, config):
        super().__init__(GuessNumberEnvConfig(high=1000))

    def step(self, action: str) -> StepResult:
        if not ProbeEnv.stepped.is_set():
            ProbeEnv.stepped.set()
            assert ProbeEnv.gate_closed.wait(30), "the test never closed the gate"
        return super().step(action)


register_env("probe_guess_env", config=ProbeEnvConfig, build=ProbeEnv, replace=True)


def _request(seed=3):
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=f"{i + 3} * {i + 5} =") for i in range(2)]
    return SampleBatch.from_prompts(recs, samples_per_prompt=4, kind="ar",
                                    sampling=ARSamplingParams(max_new_tokens=8, seed=seed))


def _agent(**kw):
    return AgentConfig(env=kw.pop("env", GuessNumberEnvConfig(high=1000)), max_turns=3, max_response_tokens=200, **kw)


class SwitchHook:
    """Suspends before the turns in ``at`` and resumes with the weights of ``versions[turn]`` (a test TurnHook)."""

    def __init__(self, bundle, at: dict[int, tuple[int, dict]]):
        self.bundle, self.at, self.paused = bundle, at, []

    def pause_before(self, turn):
        return turn in self.at

    def pause(self, turn):
        self.paused.append(turn)
        version, state = self.at[turn]
        self.bundle.module.load_state_dict(state)
        return version


class GateHook:
    """Parks at the gate while it is closed; on resume reloads ``state`` (the rollout's own version 0)."""

    def __init__(self, gate, bundle, state):
        self.gate, self.bundle, self.state, self.paused = gate, bundle, state, []

    def pause_before(self, turn):
        return self.gate.closed

    def pause(self, turn):
        self.paused.append(turn)
        self.gate.park()
        self.bundle.module.load_state_dict(self.state)
        return 0


def _weights(seed):
    return {k: v.clone() for k, v in build_tiny_lm(seed=seed).module.state_dict().items()}


def _generate(bundle, agent, hook=None, seed=3):
    agentic = AgenticEngine(TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=4)), agent)
    return agentic.generate(_request(seed), hook=hook), agentic


def _replay(bundle, batch):
    out = []
    for mb in batch.split(4):  # the engine's rescoring slices
        segs = [p.segment for p in mb.generated]
        with torch.no_grad():
            logp, _ = replay_log_probs(bundle.module, build_layout(segs, [1.0] * len(segs), pad_id=bundle.pad_token_id))
        out += [logp[j, :s.num_response_tokens] for j, s in enumerate(segs)]
    return out


@pytest.mark.parametrize("stale_turns", ["correct", "mask"])
def test_version_switch_at_a_turn_boundary(stale_turns):
    bundle = build_tiny_lm(seed=0)
    a, b = _weights(0), _weights(1)
    hook = SwitchHook(bundle, {1: (1, b)})
    batch, agentic = _generate(bundle, _agent(stale_turns=stale_turns), hook)
    assert hook.paused == [1] and agentic.last_metrics["agent/suspensions"] == 1.0
    assert agentic.last_metrics["agent/stale_model_token_frac"] > 0
    under_b = _replay(bundle, batch)  # the engine's weights are b now
    bundle.module.load_state_dict(a)
    under_a = _replay(bundle, batch)
    switched = 0
    for part, la, lb in zip(batch.generated, under_a, under_b):
        seg, turns, versions = part.segment, part.conditions[TURNS_KEY], part.conditions[TURN_VERSIONS_KEY]
        assert part.policy_version == 0  # the oldest version: staleness counts conservatively
        assert versions[:2].tolist() == [0, 0][:len(versions)] and (versions[2:] == 1).all()
        for (role, s, e), v in zip(turns.tolist(), versions.tolist()):
            if role != MODEL:
                continue
            if v == 0:  # turn 0: behaviour log-probs of the weights that sampled it (a prefix rescore under a)
                torch.testing.assert_close(seg.log_probs[s:e], la[s:e], atol=1e-5, rtol=0)
                assert bool(seg.response_mask[s:e].any()) == (stale_turns == "correct")
            else:  # later turns: the final rescore under b, exactly the trainer's replay
                assert torch.equal(seg.log_probs[s:e], lb[s:e]) and seg.response_mask[s:e].all()
                switched += 1
    assert switched > 0


def test_a_suspension_without_a_version_change_changes_nothing():
    bundle = build_tiny_lm(seed=0)
    a = _weights(0)
    plain, _ = _generate(bundle, _agent())
    hook = SwitchHook(bundle, {1: (0, a), 2: (0, a)})
    paused, agentic = _generate(bundle, _agent(), hook)
    assert hook.paused == [1, 2] and agentic.last_metrics["agent/stale_model_token_frac"] == 0.0
    for x, y in zip(plain.generated, paused.generated):
        assert torch.equal(x.segment.response_ids, y.segment.response_ids)
        assert torch.equal(x.segment.log_probs, y.segment.log_probs)
        assert torch.equal(x.segment.response_mask, y.segment.response_mask) and x.text == y.text


def test_quiesce_parks_a_running_rollout_at_a_turn_boundary_and_resume_continues_it():
    bundle = build_tiny_lm(seed=0)
    a, b = _weights(0), _weights(1)
    agent = _agent(env=ProbeEnvConfig())
    ProbeEnv.stepped.set()  # the reference run does not wait
    reference, _ = _generate(bundle, agent)
    ProbeEnv.stepped.clear()
    ProbeEnv.gate_closed.clear()
    gate = TurnGate()
    hook = GateHook(gate, bundle, a)

    def work(req):
        gate.enter()
        try:
            return _generate(bundle, agent, hook)[0]
        finally:
            gate.leave()

    pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
    manager = RolloutManager(ManagerConfig(num_shards=1, max_inflight=1, last_step=1),
                             lambda req: pool.submit(work, req), gate=gate)
    try:
        manager.pump()  # dispatches step 1
        assert ProbeEnv.stepped.wait(60)  # turn 0 is in flight
        threading.Timer(0.2, ProbeEnv.gate_closed.set).start()  # the turn goes on once quiesce closed the gate
        manager.quiesce(timeout=60)
        assert gate.all_parked() and manager.inflight == 1  # parked, not drained
        bundle.module.load_state_dict(b)  # what an eval does to the shared rollout model meanwhile
        time.sleep(0.3)
        assert manager.inflight == 1 and hook.paused and 1 <= hook.paused[0] < agent.max_turns
        manager.resume()
        batch = manager.take(1, timeout=120).results[0]
    finally:
        manager.close()
        pool.shutdown(wait=True)
    assert gate.parks >= 1
    for x, y in zip(reference.generated, batch.generated):  # nothing was sampled or scored with b
        assert torch.equal(x.segment.response_ids, y.segment.response_ids)
        assert torch.equal(x.segment.log_probs, y.segment.log_probs) and x.text == y.text


def test_gate_parks_work_that_starts_while_closed_and_fails_it_on_shutdown():
    gate = TurnGate()
    gate.close()
    errors = []

    def work():
        try:
            gate.enter()
        except InvariantError as e:
            errors.append(e)
        finally:
            gate.leave()

    t = threading.Thread(target=work)
    t.start()
    for _ in range(100):
        if gate.parks:
            break
        time.sleep(0.02)
    assert gate.parks == 1 and gate.all_parked()
    gate.shutdown()
    t.join(5)
    assert errors and "turn boundary" in str(errors[0])
