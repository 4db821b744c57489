"""DiffusionNFT through the loop: EMA rollouts with ODE sampling, v_old replayed by the trainer, config checks."""

import pytest
import torch

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop import phases
from unirl_core.loop.local import run_local

torch.set_num_threads(1)

SMALL = ["data.samples_per_prompt=4", "diffusion.engine.forward_batch_size=4", "train.micro_batch_size=4",
         "diffusion.sampling.height=32", "diffusion.sampling.width=32", "diffusion.sampling.num_steps=4",
         "report.tensorboard=false"]


def test_tiny_nft_runs_with_ema_rollouts(tmp_path):
    cfg = load_recipe("tiny-nft", [f"checkpoint.root={tmp_path}", "loop.total_steps=2", *SMALL])
    seen = []
    hist = run_local(cfg, progress=False, on_step=lambda m, b: seen.append(b))
    assert [p.policy_version for p in seen[0].generated] == [phases.EMA_POLICY_VERSION] * 8
    assert not any(bool(p.segment.sde_mask.any()) for b in seen for p in b.generated)  # ODE rollouts
    # step 1: the EMA equals the step-0 weights, so v_theta == v_old exactly before the update
    assert hist[0]["train/v_old_absdiff_max"] == 0.0
    assert hist[1]["train/v_old_absdiff_mean"] > 0.0  # afterwards the EMA lags the trained weights
    assert all(h["train/grad_norm"] > 0 for h in hist)
    assert "eval/reward/mean" in hist[1] and hist[1]["eval/samples"] == 8.0  # the recipe's eval, at the end


def test_nft_config_needs_ema_decay_and_pods(tmp_path):
    with pytest.raises(ConfigError, match="train.ema_decay"):
        load_recipe("tiny-nft", [f"checkpoint.root={tmp_path}", "train.ema_decay=null"])
    load_recipe("tiny-nft", [f"checkpoint.root={tmp_path}", "train.ema_decay=null",
                             "diffusion.algorithm.old_policy=policy", "eval.weights=policy"])
    with pytest.raises(ConfigError, match="pool.execution"):
        load_recipe("tiny-nft", [f"checkpoint.root={tmp_path}", "pool.execution=pool"])
    with pytest.raises(ConfigError, match="old_logp_source"):
        load_recipe("tiny-nft", [f"checkpoint.root={tmp_path}", "train.old_logp_source=rollout"])
