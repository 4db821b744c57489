"""The built-in toy task: small-integer arithmetic with a verifiable answer and a shaped reward.

A random-init tiny LM starts out emitting arbitrary bytes, so a 0/1 correctness reward would give
almost every group zero spread (no advantage, no learning). The reward is therefore shaped:
half of it rewards answering in the right *format* (the fraction of completion characters that
are digits), half rewards the *correct* integer. A tiny model on 2 CPUs learns the format within
a few dozen GRPO steps (mean reward ~0.02 -> ~0.5) and then starts to get sums right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from unirl_core.data.sources import register_prompt_source
from unirl_core.errors import ConfigError, field_error
from unirl_core.types import PromptRecord


@dataclass(frozen=True, kw_only=True)
class ToyArithmeticConfig:
    """Shape of the toy arithmetic prompt set."""

    num_prompts: int = 64
    """Distinct prompts (each a pair of operands)."""
    max_operand: int = 9
    """Operands are drawn from ``[0, max_operand]``."""
    template: str = "{a} + {b} ="
    """Prompt text; ``{a}`` and ``{b}`` are the operands."""
    seed: int = 0
    """Seed of the operand draw."""
    operation: Literal["add", "mul"] = "add"
    """The answer is ``a + b`` (``add``) or ``a * b`` (``mul``, e.g. with template ``'{a} * {b} ='``: the
    calculator-tool task of ``tiny-agent-calc``)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.num_prompts, int) and self.num_prompts >= 1):
            raise field_error(ConfigError, "toy.num_prompts", self.num_prompts, "an integer >= 1", "use e.g. 64")
        if not (isinstance(self.max_operand, int) and 1 <= self.max_operand <= 10**6):
            raise field_error(ConfigError, "toy.max_operand", self.max_operand, "an integer in [1, 1e6]", "use 9")
        if self.operation not in ("add", "mul"):
            raise field_error(ConfigError, "toy.operation", self.operation, "'add' or 'mul'", "use 'add'")
        if "{a}" not in self.template or "{b}" not in self.template:
            raise field_error(ConfigError, "toy.template", self.template, "a template with {a} and {b}",
                              "use e.g. '{a} + {b} ='")


def toy_arithmetic_prompts(cfg: ToyArithmeticConfig | None = None) -> list[PromptRecord]:
    """Deterministic prompts with ``targets['answer']`` = the sum (or product) as a decimal string."""
    cfg = cfg or ToyArithmeticConfig()
    g = torch.Generator().manual_seed(cfg.seed)
    ops = torch.randint(0, cfg.max_operand + 1, (cfg.num_prompts, 2), generator=g).tolist()
    return [PromptRecord(prompt_id=f"toy-{i:05d}", prompt=cfg.template.format(a=a, b=b),
                         targets={"answer": str(a * b if cfg.operation == "mul" else a + b)}) for i, (a, b) in enumerate(ops)]


def toy_arithmetic_reward(completion: str, answer: str) -> float:
    """Shaped reward in [0, 1]: ``0.5 * digit fraction + 0.5 * (completion == answer as integers)``."""
    text = completion.strip()
    if not text:
        return 0.0
    digit_frac = sum(c.isdigit() for c in text) / len(text)
    correct = text.isdigit() and int(text) == int(answer)
    return 0.5 * digit_frac + 0.5 * float(correct)


class ToyArithmeticScorer:
    """Reward-registry scorer (name ``toy_arithmetic``): ``toy_arithmetic_reward`` per ScoreItem.

    Reads ``item.text`` (the completion) and ``item.targets['answer']``; a missing answer raises,
    which the RewardService's failure policy turns into a per-item error.
    """

    score = staticmethod(toy_arithmetic_reward)

    def __call__(self, items) -> list[float]:
        out = []
        for i, item in enumerate(items):
            answer = item.targets.get("answer")
            if answer is None:
                raise field_error(ConfigError, f"items[{i}].targets['answer']", None, "the expected sum",
                                  "build prompts with toy_arithmetic_prompts() (they carry the answer)")
            out.append(self.score(item.text or "", answer))
        return out


register_prompt_source("toy_arithmetic", section="toy", config=ToyArithmeticConfig, build=toy_arithmetic_prompts)
