"""``lm.agent`` in run configs: the shipped recipe, the env choice, and the combinations the loop refuses."""

import pytest

from examples.agentic.calculator import CalculatorEnvConfig
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.rollout.agentic import check_agent_workflow


def test_tiny_agent_calc_recipe():
    cfg = load_recipe("tiny-agent-calc")
    agent = cfg.lm.agent
    assert isinstance(agent.env, CalculatorEnvConfig) and (agent.env.open_tag, agent.env.close_tag) == ("[", "]")
    assert agent.max_turns == 3 and agent.max_response_tokens == 48
    assert [c.name for c in cfg.reward.components] == ["agent_return"]
    assert load_recipe("tiny-grpo").lm.agent is None
    cfg = load_recipe("tiny-grpo", ["lm.agent.env.name=guess_number", "lm.agent.env.high=16"])
    assert cfg.lm.agent.env.high == 16 and cfg.lm.agent.max_turns == 4


@pytest.mark.parametrize("recipe, overrides, message", [
    ("tiny-agent-calc", ["lm.agent.max_turns=0"], r"lm.agent.max_turns=0: expected an integer >= 1"),
    ("tiny-agent-calc", ["lm.agent.env.name=chess"], r"recipe.lm.agent.env.name='chess': expected one of"),
    ("tiny-agent-calc", ["lm.agent.env.depth=2"], r"recipe.lm.agent.env.depth=2: expected a field of environment"),
    ("tiny-agent-calc", ["lm.agent.env.limits.max_int_bits=0"], r"limits.max_int_bits=0"),
    ("tiny-agent-calc-vllm", ["async_training.max_policy_lag=1", "checkpoint.keep_last=3"],
     r"async_training.max_policy_lag=1: expected 0 with lm.agent and lm.deployment.engine='vllm'"),
    ("tiny-agent-calc", ["async_training.max_policy_lag=1", "lm.agent.switch_at_turn=1",
                         "async_training.overlap=false"],
     r"async_training.overlap=False: expected True with lm.agent.switch_at_turn"),
    ("tiny-agent-calc", ["lm.agent.switch_at_turn=3"],
     r"lm.agent.switch_at_turn=3: expected None or an integer in \[1, max_turns=3\)"),
    ("tiny-agent-calc", ["lm.agent.switch_at_turn=1", "lm.agent.resume_version=latest"],
     r"lm.agent.switch_at_turn=1: expected None with resume_version='latest'"),
    ("tiny-agent-calc", ["lm.agent.stale_turns=drop"],
     r"lm.agent.stale_turns='drop': expected one of \('correct', 'mask'\)"),
    ("tiny-agent-calc", ["pool.execution=pool"], r"lm.agent='set': expected unset with pool.execution='pool'"),
])
def test_refused_agent_settings_name_the_field(recipe, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(recipe, overrides)


def test_agent_runs_over_vllm_and_lagged_on_the_trainside_engine():
    cfg = load_recipe("tiny-agent-calc-vllm")
    assert cfg.lm.deployment.engine == "vllm" and cfg.lm.agent.env.name == "calculator"
    assert load_recipe("tiny-grpo-vllm", ["lm.agent.env={name: calculator}", "lm.agent.max_turns=2"]).lm.agent.max_turns == 2
    cfg = load_recipe("tiny-agent-calc", ["async_training.max_policy_lag=1", "lm.agent.switch_at_turn=1"])
    assert cfg.async_training.max_policy_lag == 1 and cfg.lm.agent.switch_at_turn == 1


@pytest.mark.parametrize("overrides, message", [
    (["lm.agent.switch_at_turn=1"], r"lm.agent.switch_at_turn=1: expected None in the Flyte workflow"),
    (["lm.agent.resume_version=latest"], r"lm.agent.resume_version='latest': expected 'pinned' in the Flyte workflow"),
])
def test_the_workflow_refuses_turn_suspension_settings(overrides, message):
    cfg = load_recipe("tiny-agent-calc", ["async_training.max_policy_lag=1", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_agent_workflow(cfg)
    check_agent_workflow(load_recipe("tiny-agent-calc", ["async_training.max_policy_lag=1"]))  # pinned turns: wired
