"""``lm.agent`` in run configs: the shipped recipe, the env choice, and the combinations the loop refuses."""

import pytest

from unirl_core.config import load_recipe
from unirl_core.env.calculator import CalculatorEnvConfig
from unirl_core.errors import ConfigError


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
    ("tiny-agent-calc", ["async_training.max_policy_lag=1", "checkpoint.keep_last=3"],
     r"async_training.max_policy_lag=1: expected 0 with lm.agent"),
    ("tiny-agent-calc", ["pool.execution=pool"], r"pool.execution='pool': expected 'pods' with lm.agent"),
    ("tiny-grpo-vllm", ["lm.agent.max_turns=2"], r"lm.deployment.engine='vllm': expected 'trainside' with lm.agent"),
])
def test_refused_agent_settings_name_the_field(recipe, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(recipe, overrides)
