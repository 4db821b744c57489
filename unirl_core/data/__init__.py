"""Prompt data sets (jsonl / parquet / local HF datasets), the built-in toy arithmetic task and the shapes world."""

from unirl_core.data.prompts import PromptDataConfig, PromptDataset, load_prompts
from unirl_core.data.shapes import (
                                    ShapesPrompt,
                                    ShapesPromptsConfig,
                                    ShapesWorldConfig,
                                    caption,
                                    make_dataset,
                                    parse_caption,
                                    prompt_list,
                                    shapes_prompts,
)
from unirl_core.data.toy import (
                                    ToyArithmeticConfig,
                                    ToyArithmeticScorer,
                                    toy_arithmetic_prompts,
                                    toy_arithmetic_reward,
)

__all__ = ["PromptDataConfig", "PromptDataset", "ShapesPrompt", "ShapesPromptsConfig", "ShapesWorldConfig",
           "ToyArithmeticConfig", "ToyArithmeticScorer", "caption", "load_prompts", "make_dataset", "parse_caption",
           "prompt_list", "shapes_prompts", "toy_arithmetic_prompts", "toy_arithmetic_reward"]
