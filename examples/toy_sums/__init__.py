"""Toy sums: the tiny LM learns to get sums right (SFT warm start, then GRPO on exact-match correctness).

Registers the ``toy_correct`` scorer; recipes ``sft-toy-sums`` (sft) and ``toy-sums`` (rl). See README.md."""

from unirl_core.reward.scorers import register_scorer

register_scorer("toy_correct", "examples.toy_sums.reward:ToyCorrectScorer")
