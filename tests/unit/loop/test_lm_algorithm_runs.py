"""The LM algorithm recipes learn the toy task through run_local (about 8 s each on one CPU thread)."""

import pytest
import torch

from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local

torch.set_num_threads(1)


@pytest.mark.parametrize("recipe", ["tiny-cispo", "tiny-dapo"])
@pytest.mark.slow
def test_recipe_raises_the_task_reward(tmp_path, recipe):
    cfg = load_recipe(recipe, [f"checkpoint.root={tmp_path}", "loop.total_steps=36", "report.tensorboard=false"])
    hist = run_local(cfg, progress=False)
    reward = [h["reward/mean"] for h in hist]  # the scorer's reward, before the overlong penalty
    first, last = sum(reward[:6]) / 6, sum(reward[-6:]) / 6
    assert last > first + 0.1, (first, last)
    assert all(h["train/ratio_mean"] == 1.0 for h in hist)  # one on-policy update per batch
