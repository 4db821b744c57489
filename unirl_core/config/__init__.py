"""Typed run configuration and recipe loading."""

from unirl_core.config.loader import apply_overrides, from_dict, to_dict
from unirl_core.config.recipes import load_recipe, load_recipe_dict, recipe_names, recipe_path
from unirl_core.config.run import (
    CheckpointConfig,
    DataConfig,
    DiffusionSamplingConfig,
    DiffusionSection,
    LMSection,
    LoopConfig,
    ReportConfig,
    RunConfig,
)

__all__ = ["CheckpointConfig", "DataConfig", "DiffusionSamplingConfig", "DiffusionSection", "LMSection",
           "LoopConfig", "ReportConfig", "RunConfig", "apply_overrides", "from_dict", "load_recipe",
           "load_recipe_dict", "recipe_names", "recipe_path", "to_dict"]
