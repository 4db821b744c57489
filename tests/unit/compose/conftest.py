"""A small shapes-enhance with both stacks trained: 2 captions x 2 enhancements x 2 images (image groups per enhancement,
the recipe's paired noise), 4 denoising steps, micro-batches of 4."""

from __future__ import annotations

import pytest
import torch

from unirl_core.compose.config import load_compose_recipe

torch.set_num_threads(1)

SMALL = ["image.frozen=false", "data.prompts_per_step=2", "grouping.enhancements_per_prompt=2", "grouping.images_per_enhancement=2",
         "grouping.image_groups=enhancement",
         "enhancer.lm.engine.forward_batch_size=4", "enhancer.train.micro_batch_size=2",
         "enhancer.lm.sampling.max_new_tokens=6", "enhancer.warm_start.steps=30", "enhancer.warm_start.batch_size=16",
         "image.diffusion.sampling.num_steps=4", "image.diffusion.sampling.sde_window_size=2",
         "image.diffusion.sampling.sde_window_range=[0, 2]", "image.diffusion.engine.forward_batch_size=4",
         "image.train.micro_batch_size=4", "loop.total_steps=2", "report.tensorboard=false"]


def small_overrides(root, *extra: str, name: str = "enh") -> list[str]:
    # enhancer micro-batches must equal its engine's slices for exact rollout log-probs
    over = [o for o in SMALL if not o.startswith("enhancer.train.micro_batch_size")] + ["enhancer.train.micro_batch_size=4"]
    return [f"checkpoint.root={root}", f"name={name}", "eval=null", *over, *extra]


def small_config(root, *extra: str, name: str = "enh"):
    return load_compose_recipe("shapes-enhance", small_overrides(root, *extra, name=name))


@pytest.fixture
def small(tmp_path):
    return small_config(tmp_path)
