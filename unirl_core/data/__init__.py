"""Prompt data sets (jsonl / parquet / local HF datasets), the registry of generated prompt sets and the built-in toy
arithmetic task. The shapes world is a plugin's: ``examples/shapes``."""

from unirl_core.data.prompts import PromptDataConfig, PromptDataset, load_prompts
from unirl_core.data.sources import prompt_source, prompt_source_names, register_prompt_source
from unirl_core.data.toy import (
                                    ToyArithmeticConfig,
                                    ToyArithmeticScorer,
                                    toy_arithmetic_prompts,
                                    toy_arithmetic_reward,
)

__all__ = ["PromptDataConfig", "PromptDataset", "ToyArithmeticConfig", "ToyArithmeticScorer", "load_prompts",
           "prompt_source", "prompt_source_names", "register_prompt_source", "toy_arithmetic_prompts",
           "toy_arithmetic_reward"]
