"""The warm start of ``tiny-agent-calc``: SFT records that teach the calculator-call format (record source
``calc_tool``, settings ``data.calc``; recipe ``sft-agent-calc``).

One conversation per training prompt of the RL task (``data.calc`` holds the same toy-arithmetic fields as the RL
recipe's ``data.toy``): a fraction ``tool_frac`` of them call the calculator (``[a*b]`` -> the value -> the value
as the answer), the rest answer directly with the product. From random init the model never samples the tool
format, so RL on ``agent_return`` alone has nothing to reinforce; after this SFT it calls the tool on some prompts
and GRPO takes the rate to all of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from unirl_core.data.toy import ToyArithmeticConfig, toy_arithmetic_prompts
from unirl_core.errors import ConfigError, field_error
from unirl_core.sft.records import TextRecord


@dataclass(frozen=True)
class CalcToolRecordsConfig(ToyArithmeticConfig):
    """The RL task's prompts (the toy-arithmetic fields, as in the RL recipe's ``data.toy``) and the tool format."""

    tool_frac: float = 0.3
    """Fraction of the records that call the calculator; the others answer directly."""
    open_tag: str = "["
    """Opens a tool call (the RL recipe's ``lm.agent.env.open_tag``)."""
    close_tag: str = "]"
    """Closes a tool call (``lm.agent.env.close_tag``)."""
    instructions: str = ""
    """Text before each prompt (``lm.agent.env.instructions``)."""
    record_seed: int = 0
    """Seed of the draw of which records call the tool."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.tool_frac, (int, float)) and 0.0 <= self.tool_frac <= 1.0):
            raise field_error(ConfigError, "calc.tool_frac", self.tool_frac, "a number in [0, 1]", "use e.g. 0.3")


def calc_records(cfg) -> list[TextRecord]:
    """One multi-turn record per prompt of ``data.calc`` (see the module docstring)."""
    c: CalcToolRecordsConfig = cfg.data.section("calc")
    rng = random.Random(c.record_seed)
    out = []
    for rec in toy_arithmetic_prompts(c):
        answer = rec.targets["answer"]
        if rng.random() < c.tool_frac:
            expr = rec.prompt.rstrip(" =").replace(" ", "")
            turns = (("assistant", f"{c.open_tag}{expr}{c.close_tag}"), ("env", answer), ("assistant", answer))
        else:
            turns = (("assistant", answer),)
        out.append(TextRecord(f"{c.instructions}{rec.prompt}", "\n".join(t for _, t in turns), turns=turns))
    return out
