"""The calculator and guessing-game environments, the registry and the env config choice."""

import pytest

from examples.agentic.calculator import CalculatorEnv, CalculatorEnvConfig, answer_matches
from examples.agentic.guess import GuessNumberEnv, GuessNumberEnvConfig
from unirl_core.config.loader import from_dict, to_dict
from unirl_core.env import Environment, EnvTask, build_env, env_names, register_env
from unirl_core.env.reward import AgentReturnScorer
from unirl_core.errors import ConfigError, RewardError
from unirl_core.reward.scorers.base import ScoreItem
from unirl_core.rollout.agentic import AgentConfig


def _calc(**kw):
    env = CalculatorEnv(CalculatorEnvConfig(**kw))
    first = env.reset(EnvTask(prompt="37 * 48 =", targets={"answer": "1776"}, group_id="g"))
    return env, first


def test_calculator_tool_call_then_answer():
    env, first = _calc(instructions="Use <calc>. ")
    assert first == "Use <calc>. 37 * 48 ="
    r = env.step("let me compute <calc>37*48</calc> now")
    assert (r.observation, r.reward, r.done, r.error) == ("1776", 0.0, False, None)
    r = env.step(" 1776 ")
    assert r.done and r.reward == 1.0
    env, _ = _calc()
    r = env.step("1775")
    assert r.done and r.reward == 0.0


@pytest.mark.parametrize("action, message", [
    ("<calc>37*48", "malformed tool call: no </calc> after <calc>"),
    ("<calc>import os</calc>", "syntax error"),
    ("<calc>__import__('os')</calc>", "function '__import__' is not allowed"),
    ("<calc>9**9**9</calc>", "too large"),
    ("<calc></calc>", "empty expression"),
    ("<calc>1/0</calc>", "division by zero"),
])
def test_malformed_or_refused_tool_calls_get_an_error_observation(action, message):
    env, _ = _calc(error_reward=-0.1)
    r = env.step(action)
    assert not r.done and r.reward == -0.1 and message in r.error and r.observation == f"error: {r.error}"
    assert env.step("<calc>2+2</calc>").observation == "4"  # the episode goes on


def test_calculator_without_answer_target_is_a_config_error():
    env = CalculatorEnv()
    with pytest.raises(ConfigError, match=r"targets\['answer'\]=None"):
        env.reset(EnvTask(prompt="1 + 1 =", targets={}))
    with pytest.raises(ConfigError, match="reset"):
        CalculatorEnv().step("2")


def test_answer_matching():
    assert answer_matches("42", "42") and answer_matches(" -3 ", "-3") and answer_matches("0.5", "0.50")
    assert not answer_matches("42.", "41") and not answer_matches("forty", "40") and not answer_matches("", "0")


def test_guess_number_game_reaches_its_goal_by_bisection():
    cfg = GuessNumberEnvConfig(low=1, high=32, step_reward=-0.05)
    env = GuessNumberEnv(cfg)
    env.reset(EnvTask(prompt="", group_id="group-7"))
    sibling = GuessNumberEnv(cfg)
    sibling.reset(EnvTask(prompt="", group_id="group-7"))
    assert sibling.secret == env.secret  # one game per group
    lo, hi, turns = 1, 32, 0
    while True:
        guess = (lo + hi) // 2
        r = env.step(str(guess))
        turns += 1
        if r.done:
            assert r.reward == 1.0 and r.observation == "correct" and guess == env.secret
            break
        assert r.reward == -0.05 and r.observation in ("higher", "lower")
        lo, hi = (guess + 1, hi) if r.observation == "higher" else (lo, guess - 1)
    assert turns <= 6
    bad = env.step("banana")
    assert bad.error and not bad.done and env.step("99").error  # out of range is an error too


def test_registry_and_env_choice():
    assert {"calculator", "guess_number"} <= set(env_names())
    assert isinstance(build_env(CalculatorEnvConfig()), Environment)
    cfg = from_dict(AgentConfig, {"env": {"name": "guess_number", "high": 8}, "max_turns": 5})
    assert isinstance(cfg.env, GuessNumberEnvConfig) and cfg.env.high == 8
    assert to_dict(from_dict(AgentConfig, to_dict(cfg))) == to_dict(cfg)
    with pytest.raises(ConfigError, match=r"env.name='chess': expected one of \["):
        from_dict(AgentConfig, {"env": {"name": "chess"}})
    with pytest.raises(ConfigError, match=r"env.depth=3: expected a field of environment 'calculator'"):
        from_dict(AgentConfig, {"env": {"name": "calculator", "depth": 3}})
    with pytest.raises(ConfigError, match=r"lm.agent.max_turns=0: expected an integer >= 1"):
        AgentConfig(env=CalculatorEnvConfig(), max_turns=0)
    with pytest.raises(ConfigError, match="observation_template"):
        AgentConfig(env=CalculatorEnvConfig(), observation_template="no placeholder")
    with pytest.raises(ConfigError, match=r"env.low/high=\(5, 5\)"):
        GuessNumberEnvConfig(low=5, high=5)
    with pytest.raises(ConfigError, match="name field defaults to 'other'"):
        register_env("other", config=CalculatorEnvConfig, build=CalculatorEnv)


def test_agent_return_scorer():
    s = AgentReturnScorer()
    assert s([ScoreItem(targets={"agent_return": "0.75"})]) == [0.75]
    with pytest.raises(RewardError, match=r"targets\['agent_return'\]=None"):
        s([ScoreItem(targets={})])
    with pytest.raises(RewardError, match="finite"):
        s([ScoreItem(targets={"agent_return": "nan"})])
