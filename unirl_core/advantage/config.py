"""Configuration of the reward -> advantage step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from unirl_core.errors import ConfigError, field_error

StdScope = Literal["group", "global", "none"]
STD_SCOPES: tuple[str, ...] = ("group", "global", "none")


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How rewards become advantages.

    The advantage of sample i in group g is ``(r_i - mean_g) / (std + eps)`` where ``std`` is the
    group std (``group``, Flow-GRPO / GRPO), the std of all valid rewards in the batch (``global``),
    or 1 with eps dropped (``none``, Dr.GRPO's unscaled variant).
    """

    std_scope: StdScope = "group"
    """Which std divides the centred reward: ``group``, ``global`` (whole batch) or ``none``."""
    eps: float = 1e-4
    """Added to the std before dividing, so a near-constant group does not explode."""
    unbiased_std: bool = False
    """Use the n-1 (Bessel) std like TRL's GRPO; False uses the population std like Flow-GRPO."""
    clip: float | None = None
    """Clamp advantages to ``[-clip, clip]`` (Flow-GRPO's ``adv_clip_max``); None disables clamping."""
    drop_zero_std_groups: bool = False
    """Drop groups whose valid rewards are all equal (DAPO dynamic sampling); they carry no signal."""
    zero_std_atol: float = 1e-6
    """A group counts as zero-std when its population std is <= this."""

    def __post_init__(self) -> None:
        if self.std_scope not in STD_SCOPES:
            raise field_error(ConfigError, "advantage.std_scope", self.std_scope, f"one of {STD_SCOPES}",
                              "use 'group' for GRPO / Flow-GRPO")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps >= 0):
            raise field_error(ConfigError, "advantage.eps", self.eps, "a finite value >= 0", "use e.g. 1e-4")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise field_error(ConfigError, "advantage.clip", self.clip, "a finite value > 0 or None",
                              "use e.g. 5.0, or None to disable clamping")
        if not (math.isfinite(self.zero_std_atol) and self.zero_std_atol >= 0):
            raise field_error(ConfigError, "advantage.zero_std_atol", self.zero_std_atol, "a finite value >= 0",
                              "use e.g. 1e-6")


@dataclass(frozen=True, kw_only=True)
class StatTrackerConfig:
    """Per-prompt statistics across steps (Flow-GRPO's ``per_prompt_stat_tracking``)."""

    buffer_size: int = 32
    """How many of a prompt's most recent rewards are kept (older ones fall out)."""
    min_count: int = 16
    """Below this many buffered rewards a prompt is normalised with the current batch's mean/std."""

    def __post_init__(self) -> None:
        if not (isinstance(self.buffer_size, int) and self.buffer_size >= 1):
            raise field_error(ConfigError, "stat_tracker.buffer_size", self.buffer_size, "an integer >= 1",
                              "keep at least one reward per prompt, e.g. 32")
        if not (isinstance(self.min_count, int) and 1 <= self.min_count <= self.buffer_size):
            raise field_error(ConfigError, "stat_tracker.min_count", self.min_count,
                              f"an integer in [1, buffer_size={self.buffer_size}]",
                              "a min count above the buffer size could never be reached")
