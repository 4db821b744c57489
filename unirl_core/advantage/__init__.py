"""Reward -> advantage: pure group normalisation, per-prompt stat tracking, zero-std filtering."""

from unirl_core.advantage.batch import AdvantageStats, assign_advantages, drop_zero_std_groups
from unirl_core.advantage.config import AdvantageConfig, StatTrackerConfig, StdScope
from unirl_core.advantage.group import (
    clip_advantages,
    global_std,
    group_advantages,
    group_moments,
    zero_std_groups,
)
from unirl_core.advantage.tracker import PerPromptStatTracker

__all__ = [
    "AdvantageConfig", "AdvantageStats", "PerPromptStatTracker", "StatTrackerConfig", "StdScope",
    "assign_advantages", "clip_advantages", "drop_zero_std_groups", "global_std", "group_advantages", "group_moments", "zero_std_groups",
]
