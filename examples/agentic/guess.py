"""A small text game with a checkable goal: guess the hidden integer from "higher" / "lower" hints.

The secret is drawn from a stable hash of ``(seed, group_id)``, so the siblings of a group play the same game
(their returns are comparable, as GRPO needs) and a rerun sees the same secrets. Each model turn is one guess;
the observation says ``higher`` / ``lower``, or ``error: ...`` for a turn that is not one integer in range.
Finding the secret ends the episode with reward 1; every wrong or invalid guess adds ``step_reward``
(a per-turn shaping term, e.g. -0.05, so shorter searches score higher). Binary search needs
``ceil(log2(high - low + 1))`` guesses at most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from unirl_core.env import EnvTask, StepResult, register_env
from unirl_core.errors import ConfigError, field_error
from unirl_core.sde.noise import stable_seed


@dataclass(frozen=True, kw_only=True)
class GuessNumberEnvConfig:
    """The guessing game (``lm.agent.env: {name: guess_number, ...}``)."""

    name: Literal["guess_number"] = field(default="guess_number", init=False)
    low: int = 1
    """Smallest possible secret."""
    high: int = 32
    """Largest possible secret."""
    seed: int = 0
    """Seed of the secrets (hashed with the group id)."""
    step_reward: float = 0.0
    """Step reward of a wrong or invalid guess (shaping)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.low, int) and isinstance(self.high, int) and self.low < self.high):
            raise field_error(ConfigError, "env.low/high", (self.low, self.high), "integers with low < high",
                              "use e.g. low 1, high 32")
        if not math.isfinite(self.step_reward):
            raise field_error(ConfigError, "env.step_reward", self.step_reward, "a finite number", "use 0.0")


class GuessNumberEnv:
    """One game (see the module docstring)."""

    def __init__(self, config: GuessNumberEnvConfig | None = None) -> None:
        self.config = config or GuessNumberEnvConfig()
        self.secret: int | None = None

    def reset(self, task: EnvTask) -> str:
        c = self.config
        self.secret = c.low + stable_seed(c.seed, "guess", task.group_id) % (c.high - c.low + 1)
        intro = f"I am thinking of an integer from {c.low} to {c.high}. Guess it: answer with one number."
        return f"{task.prompt}\n{intro}" if task.prompt else intro

    def step(self, action: str) -> StepResult:
        if self.secret is None:
            raise field_error(ConfigError, "env", "not reset", "reset(task) before step()", "call reset first")
        c = self.config
        text = action.strip()
        if not text.lstrip("-").isdigit() or len(text) > 12 or not c.low <= int(text) <= c.high:
            msg = f"answer with one integer from {c.low} to {c.high}"
            return StepResult(observation=f"error: {msg}", reward=c.step_reward, error=msg)
        guess = int(text)
        if guess == self.secret:
            return StepResult(observation="correct", reward=1.0, done=True)
        return StepResult(observation="higher" if guess < self.secret else "lower", reward=c.step_reward)


register_env("guess_number", config=GuessNumberEnvConfig, build=GuessNumberEnv)
