"""The ``agent_return`` scorer: the trajectory return an agentic rollout computed with its environment."""

from __future__ import annotations

import math

from unirl_core.errors import RewardError, field_error

RETURN_TARGET = "agent_return"
"""``Part.targets`` key the agentic engine writes (``unirl_core.rollout.agentic``)."""


class AgentReturnScorer:
    """Reward-registry scorer (name ``agent_return``): ``float(item.targets['agent_return'])`` per item.

    The environment judged the episode during rollout (it alone knows a game's hidden state); the reward phase
    reads that verdict, so weighting, failure policy and statistics stay the RewardService's. A Part without it
    was not sampled by the agentic engine: the scorer raises (the service's failure policy decides)."""

    def __call__(self, items) -> list[float]:
        out = []
        for i, item in enumerate(items):
            raw = item.targets.get(RETURN_TARGET)
            if raw is None:
                raise field_error(RewardError, f"items[{i}].targets[{RETURN_TARGET!r}]", None,
                                  "the return of an agentic rollout", "set lm.agent in the run config (the agentic "
                                  "engine writes it), or score with another reward")
            value = float(raw)
            if not math.isfinite(value):
                raise field_error(RewardError, f"items[{i}].targets[{RETURN_TARGET!r}]", raw, "a finite number",
                                  "check the environment's step rewards")
            out.append(value)
        return out
