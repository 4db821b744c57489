"""ComposeEvalConfig (its own module: ``compose.config`` holds it, ``compose.evaluate`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from unirl_core.errors import check_ints

EVAL_SEED = 20_261_130
"""Base seed of the evaluation's noise recipe and greedy enhancer (fixed: every evaluation renders the same noise)."""


@dataclass(frozen=True, kw_only=True)
class ComposeEvalConfig:
    """When and how widely a compose run is evaluated."""

    every_n_steps: int = 10
    """Evaluate after every this many steps (and at step 0 and the last step)."""
    images_per_prompt: int = 8
    """Images per prompt (fixed noise), for the enhancement and for the copy baseline each."""

    def __post_init__(self) -> None:
        check_ints("eval", self, ("every_n_steps", "images_per_prompt"), "use e.g. 10 / 8")

    def due(self, step: int, total: int) -> bool:
        return step == 0 or step == total or step % self.every_n_steps == 0
