"""Prompt data sets (jsonl / parquet / local HF datasets) and the built-in toy arithmetic task."""

from unirl_core.data.prompts import PromptDataConfig, PromptDataset, load_prompts
from unirl_core.data.toy import (ToyArithmeticConfig, ToyArithmeticScorer, toy_arithmetic_prompts,
                                  toy_arithmetic_reward)

__all__ = ["PromptDataConfig", "PromptDataset", "ToyArithmeticConfig", "ToyArithmeticScorer", "load_prompts",
           "toy_arithmetic_prompts", "toy_arithmetic_reward"]
