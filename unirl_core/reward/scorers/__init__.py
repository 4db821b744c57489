"""Scorers by name. Heavy dependencies (rapidocr, transformers, math-verify) load on first build."""

from unirl_core.reward.scorers.base import (
    ComponentScores,
    ScoreItem,
    Scorer,
    build_scorer,
    register_scorer,
    run_scorer,
    scorer_names,
)

__all__ = ["ComponentScores", "ScoreItem", "Scorer", "build_scorer", "register_scorer", "run_scorer",
           "scorer_names"]
