"""The ``eval`` section: when and how a run evaluates its versions (the phase is ``unirl_core.loop.evaluate``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from unirl_core.errors import ConfigError, check_ints, field_error


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """When and how the run is evaluated (``eval`` section; None: never)."""

    every_n_steps: int = 0
    """Evaluate after every n-th training step (0: only ``at_end``)."""
    at_end: bool = True
    """Also evaluate the last step's version."""
    at_start: bool = True
    """Also evaluate the starting version of a new run (step 0, before any update): the "before" of the run
    report's before/after comparison. A resumed run does not evaluate its resume point again."""
    weights: Literal["policy", "ema"] = "policy"
    """The version's policy weights or its EMA weights (``train.ema_decay`` required)."""
    prompts: tuple[str, ...] = ()
    """Held-out prompt texts; empty: ``num_prompts`` drawn from the generated prompt set with a held-out seed."""
    num_prompts: int = 8
    """Prompts drawn when ``prompts`` is empty."""
    samples_per_prompt: int = 1
    """Samples per prompt (each from its own fixed noise for diffusion; identical for greedy LMs)."""
    seed: int = 20_251_130
    """Base seed of the fixed eval noise (diffusion)."""

    def __post_init__(self) -> None:
        check_ints("eval", self, ("every_n_steps",), "use 0 to evaluate only at the end", minimum=0)
        check_ints("eval", self, ("num_prompts", "samples_per_prompt"), "use e.g. 8")
        if self.weights not in ("policy", "ema"):
            raise field_error(ConfigError, "eval.weights", self.weights, "'policy' or 'ema'", "use 'policy'")
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if self.every_n_steps == 0 and not self.at_end and not self.at_start:
            raise field_error(ConfigError, "eval", "every_n_steps=0, at_end=false, at_start=false",
                              "an evaluation at some step",
                              "set eval.every_n_steps, or eval.at_end: true, or remove the eval section")

    def due(self, step: int, total_steps: int) -> bool:
        """Whether the version of training step ``step`` is evaluated (step 0: the starting version)."""
        if step == 0:
            return self.at_start
        return (self.every_n_steps > 0 and step % self.every_n_steps == 0) or (self.at_end and step == total_steps)


def check_eval_config(cfg) -> None:
    """Refuse an eval section the run cannot serve (called from ``RunConfig``)."""
    ev = cfg.eval
    if ev is None:
        return
    if ev.weights == "ema" and cfg.train.ema_decay is None:
        raise field_error(ConfigError, "eval.weights", "ema", "'policy' without train.ema_decay",
                          "set train.ema_decay (e.g. 0.9) so versions carry EMA weights, or eval.weights: policy")
    if not ev.prompts and cfg.data.source in ("inline", "file"):
        raise field_error(ConfigError, "eval.prompts", (), f"held-out prompts for data.source={cfg.data.source!r}",
                          "list eval.prompts (only generated prompt sets, e.g. toy_arithmetic and shapes, can draw "
                          "held-out prompts themselves)")
