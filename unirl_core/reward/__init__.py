"""Reward phase: RewardService over local scorers or a remote reward server."""

from unirl_core.reward.config import FailurePolicy, RewardBackend, RewardComponent, RewardConfig
from unirl_core.reward.scorers import (
    ComponentScores,
    ScoreItem,
    Scorer,
    build_scorer,
    register_scorer,
    run_scorer,
    scorer_names,
)
from unirl_core.reward.service import RewardService, RewardStats

__all__ = [
    "ComponentScores", "FailurePolicy", "RewardBackend", "RewardComponent", "RewardConfig", "RewardService",
    "RewardStats", "ScoreItem", "Scorer", "build_scorer", "register_scorer", "run_scorer", "scorer_names",
]
