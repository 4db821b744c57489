"""Agentic multi-turn rollouts over the tiny LM: trajectory layout and masks, finish reasons, zero gradient on
environment tokens, exact first-update ratio through TrainBackend, Arrow round trip."""

import itertools
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from examples.agentic.calculator import CalculatorEnvConfig
from examples.agentic.guess import GuessNumberEnv, GuessNumberEnvConfig
from unirl_core.algorithms.grpo import GRPO, GRPOConfig
from unirl_core.env import EnvTask, StepResult, register_env
from unirl_core.errors import EngineError
from unirl_core.io import read_batch, write_batch
from unirl_core.models.lm import build_layout, build_tiny_lm, replay_log_probs
from unirl_core.models.text import decode_completion
from unirl_core.rollout.agentic import (
    ENV,
    MODEL,
    TEXT_SPANS_KEY,
    TURN_REWARDS_KEY,
    TURNS_KEY,
    AgentConfig,
    AgenticEngine,
    agent_finish,
)
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.train.backend import TrainBackend
from unirl_core.train.config import TrainConfig
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


@dataclass(frozen=True, kw_only=True)
class FailingEnvConfig:
    """Test environment whose second step raises (an environment bug)."""

    name: Literal["failing_test_env"] = field(default="failing_test_env", init=False)


class FailingEnv:
    def __init__(self, config):
        self.steps = 0

    def reset(self, task):
        return task.prompt

    def step(self, action):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("environment bug")
        return StepResult(observation="go on")


register_env("failing_test_env", config=FailingEnvConfig, build=FailingEnv, replace=True)


def _request(n_prompts=2, k=4, max_new_tokens=8, seed=0, targets=None):
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=f"{i + 3} * {i + 5} =", targets=targets or {"answer": "0"})
            for i in range(n_prompts)]
    return SampleBatch.from_prompts(recs, samples_per_prompt=k, kind="ar",
                                    sampling=ARSamplingParams(max_new_tokens=max_new_tokens, seed=seed))


def _rollout(bundle, agent: AgentConfig, *, fbs=4, **kw):
    engine = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=fbs))
    agentic = AgenticEngine(engine, agent)
    return agentic.generate(_request(**kw)), agentic, engine


def _guess(**kw):
    return AgentConfig(env=GuessNumberEnvConfig(high=1000, step_reward=-0.1), **kw)


def test_trajectory_is_one_masked_segment_with_turn_structure():
    bundle = build_tiny_lm(seed=0)
    batch, agentic, engine = _rollout(bundle, _guess(max_turns=3, max_response_tokens=200))
    tok = bundle.tokenizer
    assert agentic.last_metrics["agent/env_tokens_frac"] > 0
    for part in batch.generated:
        seg, turns = part.segment, part.conditions[TURNS_KEY]
        first = GuessNumberEnv(agentic.config.env).reset(EnvTask(prompt=part.prompt, group_id=part.group_id))
        assert torch.equal(seg.prompt_ids, engine.encode_prompt(first))  # the environment's first message
        roles = turns[:, 0].tolist()
        assert roles[0] == MODEL and all(a != b for a, b in itertools.pairwise(roles))  # alternating, model first
        assert turns[0, 1] == 0 and turns[-1, 2] == seg.num_response_tokens
        assert torch.equal(turns[1:, 1], turns[:-1, 2])  # contiguous spans
        want_mask = torch.cat([torch.full((int(b - a),), r == MODEL) for r, a, b in turns.tolist()])
        assert torch.equal(seg.response_mask, want_mask)
        spans = part.conditions[TEXT_SPANS_KEY].tolist()
        for (role, a, b), (ca, cb) in zip(turns.tolist(), spans):
            text = part.text[ca:cb]
            if role == ENV:
                decoded = tok.decode(seg.response_ids[a:b].tolist())
                assert decoded == agentic.config.observation_template.format(observation=text)
                assert text.startswith("error:") or text in ("higher", "lower")
            else:
                assert text == decode_completion(tok, seg.response_ids[a:b].tolist(), skip_ids=bundle.eos_token_ids)
        rewards = part.conditions[TURN_REWARDS_KEY]
        assert rewards.shape == (turns.shape[0],) and (rewards[turns[:, 0] == ENV] == 0).all()
        assert float(part.targets["agent_return"]) == pytest.approx(
            1.0 if agent_finish(part) == "done" else 0.0)  # shaping_weight 0: the final reward only


def test_finish_reasons():
    bundle = build_tiny_lm(seed=0)
    b, _, _ = _rollout(bundle, _guess(max_turns=2, max_response_tokens=200))
    assert {agent_finish(p) for p in b.generated} == {"max_turns"}
    assert {p.segment.finish_reason for p in b.generated} == {"length"}
    assert all(int((p.conditions[TURNS_KEY][:, 0] == MODEL).sum()) == 2 for p in b.generated)
    b, _, _ = _rollout(bundle, _guess(max_turns=4, max_response_tokens=20), max_new_tokens=8)
    assert {agent_finish(p) for p in b.generated} == {"max_tokens"}
    assert all(p.segment.num_response_tokens <= 20 for p in b.generated)
    b, _, _ = _rollout(bundle, AgentConfig(env=FailingEnvConfig(), max_turns=4, max_response_tokens=200))
    assert {agent_finish(p) for p in b.generated} == {"env_error"}
    assert {p.segment.finish_reason for p in b.generated} == {"abort"}
    assert all(int((p.conditions[TURNS_KEY][:, 0] == MODEL).sum()) == 2 for p in b.generated)
    b, agentic, _ = _rollout(bundle, AgentConfig(env=CalculatorEnvConfig(), max_turns=3, max_response_tokens=200), targets={"answer": "15"})
    assert all(agent_finish(p) in ("done", "max_turns", "max_tokens") for p in b.generated)
    assert agentic.last_metrics["agent/finish_done"] > 0


def test_reset_failure_names_the_sample():
    bundle = build_tiny_lm(seed=0)
    engine = AgenticEngine(TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=4)), AgentConfig(env=CalculatorEnvConfig()))
    req = SampleBatch.from_prompts([PromptRecord(prompt_id="p0", prompt="1 + 1 =")], samples_per_prompt=2,
                                   kind="ar", sampling=ARSamplingParams())
    with pytest.raises(EngineError, match=r"batch\[0\] \(p0/0\) env.reset='ConfigError'"):
        engine.generate(req)


def test_rollouts_are_reproducible_from_the_seed():
    bundle = build_tiny_lm(seed=0)
    a, _, _ = _rollout(bundle, _guess(max_turns=3, max_response_tokens=200), seed=5)
    b, _, _ = _rollout(bundle, _guess(max_turns=3, max_response_tokens=200), seed=5)
    c, _, _ = _rollout(bundle, _guess(max_turns=3, max_response_tokens=200), seed=6)
    same = [torch.equal(x.segment.response_ids, y.segment.response_ids) for x, y in zip(a.generated, b.generated)]
    assert all(same)
    assert not all(torch.equal(x.segment.response_ids, y.segment.response_ids)
                   for x, y in zip(a.generated, c.generated))


def test_environment_tokens_get_zero_gradient():
    # Through the real model: the post-norm hidden state at column j only feeds the log-prob of token j + 1,
    # so its gradient is the gradient the loss sends to that token. Environment tokens must get exactly none.
    torch.manual_seed(0)
    bundle = build_tiny_lm(seed=0)
    batch, _, _ = _rollout(bundle, _guess(max_turns=3, max_response_tokens=200))
    for i, s in enumerate(batch.samples):
        s.generated.advantage = [1.0, -0.5, 0.25, -1.0][i % 4]
    model = bundle.module
    saved = {}

    def keep(module, inputs, output):
        output.retain_grad()
        saved["h"] = output

    hook = model.model.norm.register_forward_hook(keep)
    try:
        out = GRPO(GRPOConfig()).loss(bundle, batch, old_log_probs=None)
        out.loss.backward()
    finally:
        hook.remove()
    grad = saved["h"].grad.abs().sum(-1)  # [B, P + R]
    layout = build_layout([p.segment for p in batch.generated], [1.0] * len(batch), pad_id=bundle.pad_token_id)
    p = layout.input_ids.shape[1] - layout.targets.shape[1]
    for b, part in enumerate(batch.generated):
        seg = part.segment
        g = grad[b, p - 1:p - 1 + seg.num_response_tokens]  # column p - 1 + t predicts response token t
        env = ~seg.response_mask
        assert env.any() and (g[env] == 0).all(), "an environment token received gradient"
        assert (g[seg.response_mask] > 0).all(), "a model token received no gradient"


def test_first_update_ratio_is_exactly_one_through_train_backend():
    bundle = build_tiny_lm(seed=0)
    batch, agentic, _ = _rollout(bundle, _guess(max_turns=3, max_response_tokens=200), fbs=4)
    assert agentic.last_metrics["agent/env_tokens_frac"] > 0
    for i, s in enumerate(batch.samples):
        s.generated.advantage = [1.0, -1.0, 0.5, -0.5][i % 4]
    backend = TrainBackend(bundle, GRPO(GRPOConfig(max_logp_absdiff=0.0)),
                           TrainConfig(lr=1e-3, micro_batch_size=4, old_logp_source="rollout"))
    m = backend.step(batch).as_dict()
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["logp_absdiff_max"] == 0.0


def test_stored_log_probs_equal_a_replay_and_survive_arrow(tmp_path):
    bundle = build_tiny_lm(seed=0)
    batch, _, _ = _rollout(bundle, _guess(max_turns=3, max_response_tokens=200), fbs=4)
    for mb in batch.split(4):
        segs = [p.segment for p in mb.generated]
        with torch.no_grad():
            logp, _ = replay_log_probs(bundle.module, build_layout(segs, [1.0] * 4, pad_id=bundle.pad_token_id))
        for j, s in enumerate(segs):
            assert torch.equal(logp[j, :s.num_response_tokens], s.log_probs)
    write_batch(batch, tmp_path / "agent.arrow")
    back = read_batch(tmp_path / "agent.arrow")
    for x, y in zip(batch.generated, back.generated):
        assert torch.equal(x.segment.response_mask, y.segment.response_mask) and x.text == y.text
        assert agent_finish(x) == agent_finish(y) and x.targets == y.targets
        for key in (TURNS_KEY, TEXT_SPANS_KEY, TURN_REWARDS_KEY):
            assert torch.equal(x.conditions[key], y.conditions[key])


def test_return_is_final_reward_plus_weighted_shaping():
    bundle = build_tiny_lm(seed=0)
    batch, _, _ = _rollout(bundle, _guess(max_turns=3, max_response_tokens=200, shaping_weight=0.5))
    for part in batch.generated:
        turns, rewards = part.conditions[TURNS_KEY], part.conditions[TURN_REWARDS_KEY]
        steps = rewards[turns[:, 0] == MODEL].tolist()
        final = steps[-1] if agent_finish(part) == "done" else 0.0
        shaping = sum(steps[:-1]) if agent_finish(part) == "done" else sum(steps)
        assert all(r == pytest.approx(-0.1) for r in (steps[:-1] if final else steps))
        assert float(part.targets["agent_return"]) == pytest.approx(final + 0.5 * shaping)
