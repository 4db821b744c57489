"""The warm start of ``tiny-agent-calc``: SFT records that teach the calculator-call format (record source
``calc_tool``, settings ``data.calc``; recipe ``sft-agent-calc``).

One conversation per training prompt of the RL recipe ``data.calc.rl_recipe`` names (its ``data.toy`` prompts and
its ``lm.agent.env`` tool tags, read from it): a fraction ``tool_frac`` of them call the calculator (``[a*b]`` -> the value -> the value
as the answer), the rest answer directly with the product. From random init the model never samples the tool
format, so RL on ``agent_return`` alone has nothing to reinforce; after this SFT it calls the tool on some prompts
and GRPO takes the rate to all of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from unirl_core.data.toy import toy_arithmetic_prompts
from unirl_core.errors import ConfigError, field_error
from unirl_core.sft.records import TextRecord


@dataclass(frozen=True, kw_only=True)
class CalcToolRecordsConfig:
    """Which RL recipe's task the records teach, and how many of them call the tool."""

    rl_recipe: str = "tiny-agent-calc"
    """The RL recipe whose training prompts (``data.toy``) and tool format (``lm.agent.env``: tags, instructions)
    the records use, read from it rather than repeated here."""
    tool_frac: float = 0.3
    """Fraction of the records that call the calculator; the others answer directly."""
    record_seed: int = 0
    """Seed of the draw of which records call the tool."""

    def __post_init__(self) -> None:
        if isinstance(self.tool_frac, bool) or not (isinstance(self.tool_frac, (int, float))
                                                    and 0.0 <= self.tool_frac <= 1.0):
            raise field_error(ConfigError, "calc.tool_frac", self.tool_frac, "a number in [0, 1]", "use e.g. 0.3")


def calc_records(cfg) -> list[TextRecord]:
    """One multi-turn record per training prompt of ``data.calc.rl_recipe`` (see the module docstring)."""
    from unirl_core.config.recipes import load_recipe

    c: CalcToolRecordsConfig = cfg.data.section("calc")
    rl = load_recipe(c.rl_recipe)
    env = rl.lm.agent.env if rl.lm.agent is not None else None
    if env is None or not hasattr(env, "open_tag"):
        raise field_error(ConfigError, "data.calc.rl_recipe", c.rl_recipe, "an RL recipe with a calculator agent",
                          "name one whose lm.agent.env is {name: calculator}, e.g. tiny-agent-calc")
    rng = random.Random(c.record_seed)
    out = []
    for rec in toy_arithmetic_prompts(rl.data.section("toy")):
        answer = rec.targets["answer"]
        if rng.random() < c.tool_frac:
            expr = rec.prompt.rstrip(" =").replace(" ", "")  # "37 * 48 =" -> "37*48"
            turns = (("assistant", f"{env.open_tag}{expr}{env.close_tag}"), ("env", answer), ("assistant", answer))
        else:
            turns = (("assistant", answer),)
        out.append(TextRecord(f"{env.instructions}{rec.prompt}", "\n".join(t for _, t in turns), turns=turns))
    return out
