"""The calculator tool environment: the model may call a sandboxed calculator, then gives its answer.

Protocol (one model turn = one ``step``):

- a turn containing ``<calc>EXPR</calc>`` is a tool call: the observation is the value of ``EXPR``
  (``unirl_core.env.sandbox``) or ``error: ...``; the episode goes on;
- a turn with an opening tag and no closing tag is a malformed call: ``error: ...`` observation;
- any other turn is the final answer: reward 1 when it equals ``targets[answer_key]`` as a number, else 0;
  the episode ends.

A task without the answer target raises ``ConfigError`` (a broken data set, not a model mistake): the engine
ends that trajectory with finish reason ``env_error``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from unirl_core.env import EnvTask, StepResult, register_env
from unirl_core.env.sandbox import SandboxLimits, ToolError, evaluate, format_number
from unirl_core.errors import ConfigError, field_error


@dataclass(frozen=True, kw_only=True)
class CalculatorEnvConfig:
    """The calculator environment (``lm.agent.env: {name: calculator, ...}``)."""

    name: Literal["calculator"] = field(default="calculator", init=False)
    open_tag: str = "<calc>"
    """Start of a tool call in a model turn."""
    close_tag: str = "</calc>"
    """End of a tool call."""
    answer_key: str = "answer"
    """Key of the expected answer in the Part's ``targets``."""
    instructions: str = ""
    """Text put before the task in the first user message (e.g. how to call the tool); empty: the task alone."""
    tool_reward: float = 0.0
    """Step reward of a tool call that evaluated (shaping; enters the return times ``shaping_weight``)."""
    error_reward: float = 0.0
    """Step reward of a malformed or refused tool call (shaping, e.g. -0.1)."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    """Bounds of one evaluation (characters, nodes, depth, integer bits, seconds)."""

    def __post_init__(self) -> None:
        for name in ("open_tag", "close_tag"):
            if not getattr(self, name):
                raise field_error(ConfigError, f"env.{name}", getattr(self, name), "a non-empty tag",
                                  "use '<calc>' and '</calc>'")
        if not self.answer_key:
            raise field_error(ConfigError, "env.answer_key", self.answer_key, "a targets key", "use 'answer'")
        for name in ("tool_reward", "error_reward"):
            if not math.isfinite(getattr(self, name)):
                raise field_error(ConfigError, f"env.{name}", getattr(self, name), "a finite number", "use 0.0")


def answer_matches(text: str, answer: str) -> bool:
    """``text`` (stripped) is a number equal to ``answer`` (integers exactly, floats to 1e-9 relative)."""
    t = text.strip()
    try:
        if t.lstrip("-").isdigit() and answer.strip().lstrip("-").isdigit():
            return int(t) == int(answer)
        got, want = float(t), float(answer)
    except ValueError:
        return False
    return math.isfinite(got) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)


class CalculatorEnv:
    """One calculator episode (see the module docstring)."""

    def __init__(self, config: CalculatorEnvConfig | None = None) -> None:
        self.config = config or CalculatorEnvConfig()
        self._answer: str | None = None

    def reset(self, task: EnvTask) -> str:
        answer = task.targets.get(self.config.answer_key)
        if answer is None:
            raise field_error(ConfigError, f"targets[{self.config.answer_key!r}]", None,
                              "the expected answer of every calculator task",
                              "build prompts that carry it (e.g. data.source toy_arithmetic)")
        self._answer = answer
        return f"{self.config.instructions}{task.prompt}"

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise field_error(ConfigError, "env", "not reset", "reset(task) before step()", "call reset first")
        c = self.config
        start = action.find(c.open_tag)
        if start < 0:
            return StepResult(observation="", reward=float(answer_matches(action, self._answer)), done=True)
        end = action.find(c.close_tag, start + len(c.open_tag))
        if end < 0:
            msg = f"malformed tool call: no {c.close_tag} after {c.open_tag}"
            return StepResult(observation=f"error: {msg}", reward=c.error_reward, error=msg)
        try:
            value = evaluate(action[start + len(c.open_tag):end], c.limits)
        except ToolError as e:
            return StepResult(observation=f"error: {e}", reward=c.error_reward, error=str(e))
        return StepResult(observation=format_number(value), reward=c.tool_reward)


register_env("calculator", config=CalculatorEnvConfig, build=CalculatorEnv)
