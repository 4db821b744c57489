"""Composed prompt enhancement: an AR enhancer Part chained into a diffusion Part, both trained (see README.md)."""

from unirl_core.compose.config import (
    ComposeRunConfig,
    EnhancerStack,
    GroupingConfig,
    ImageStack,
    WarmStartConfig,
    compose_recipe_names,
    load_compose_recipe,
    stack_configs,
)
from unirl_core.compose.credit import assign_compose_advantages, enhancer_batch, image_batch, propagate_rewards
from unirl_core.compose.engine import check_composed, compose_rollout, enhancement_id

__all__ = [
    "ComposeRunConfig", "EnhancerStack", "GroupingConfig", "ImageStack", "WarmStartConfig", "assign_compose_advantages",
    "check_composed", "compose_recipe_names", "compose_rollout", "enhancement_id", "enhancer_batch", "image_batch",
    "load_compose_recipe", "propagate_rewards", "stack_configs",
]
