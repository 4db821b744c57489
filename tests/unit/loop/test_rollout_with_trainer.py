"""loop.rollout_with_trainer: run_local samples with the trainer's own module (one copy of the weights, no copy per
step; the default wherever it applies) and trains bitwise the rollout bundle's trajectory; settings it cannot honour
are refused naming the field when it is asked for explicitly."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from tests.flyte.conftest import SMALL
from unirl_core.loop.executors import in_process
from unirl_core.checkpoint import CheckpointStore
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local

NFT = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=4",
       "diffusion.engine.forward_batch_size=4", "diffusion.sampling.num_steps=4", "eval=null"]
BF16 = {"tiny-grpo": ["lm.model.dtype=bfloat16"], "tiny-flow-grpo": ["diffusion.model.dtype=bfloat16"]}
KEYS = ("reward/mean", "train/loss", "train/grad_norm", "train/ratio_min", "train/ratio_max")


def _cfg(recipe: str, root, steps: int, *extra: str):
    small = NFT if recipe == "tiny-nft" else SMALL[recipe]
    return load_recipe(recipe, [*small, f"loop.total_steps={steps}", f"checkpoint.root={root}",
                                "report.tensorboard=false", "report.progress=false", "checkpoint.keep_last=10", *extra])


def _versions(root, run: str) -> dict[int, dict[str, torch.Tensor]]:
    store = CheckpointStore(str(root), run)
    return {v.step: safetensors.torch.load_file(f"{root}/{run}/step-{v.step:08d}/model.safetensors")
            for v in store.versions()}


@pytest.mark.parametrize("recipe, precision", [("tiny-grpo", "fp32"), ("tiny-flow-grpo", "fp32"), ("tiny-nft", "fp32"),
                                               ("tiny-grpo", "bf16"), ("tiny-flow-grpo", "bf16")])
@pytest.mark.slow
def test_rollout_with_the_trainer_module_is_bitwise_the_default_run(tmp_path, monkeypatch, recipe, precision):
    """tiny-nft samples with the trainer's EMA (its rollout weights); bf16: fp32 masters read as bf16 casts."""
    torch.set_num_threads(1)
    extra = BF16[recipe] if precision == "bf16" else []
    steps = 3
    ref = run_local(_cfg(recipe, tmp_path / "ref", steps, *extra, "loop.rollout_with_trainer=false"))
    monkeypatch.setattr(in_process().resources, "_bundles", {})  # what the shared run builds, and only that
    got = run_local(_cfg(recipe, tmp_path / "shared", steps, *extra))  # the default: on wherever it applies
    keys = [k for k in KEYS if k in ref[0]]  # DiffusionNFT has no ratio
    assert "train/loss" in keys
    for a, b in zip(ref, got, strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys]
    assert [h["rollout/with_trainer"] for h in got] == [1.0] * steps
    assert [h["rollout/trainer_restored"] for h in got] == [1.0] + [0.0] * (steps - 1)  # step 1 restores v0
    if "train/ratio_min" in keys:
        assert got[0]["train/ratio_min"] == got[0]["train/ratio_max"] == 1.0
    assert in_process().resources._bundles == {}  # no rollout bundle: the process held one copy of the weights
    name = _cfg(recipe, tmp_path, 1).name
    va, vb = _versions(tmp_path / "ref", name), _versions(tmp_path / "shared", name)
    assert va.keys() == vb.keys() == set(range(steps + 1))
    for step in va:
        assert va[step].keys() == vb[step].keys()
        assert all(torch.equal(va[step][k], vb[step][k]) for k in va[step]), f"version {step} differs"


def test_a_resumed_run_restores_in_its_first_rollout(tmp_path):
    torch.set_num_threads(1)
    ref = run_local(_cfg("tiny-grpo", tmp_path / "ref", 4))
    cfg2 = _cfg("tiny-grpo", tmp_path / "shared", 2, "loop.rollout_with_trainer=true")
    run_local(cfg2)
    in_process().resources.forget_trainer()  # a new process: nothing resident
    rest = run_local(_cfg("tiny-grpo", tmp_path / "shared", 4, "loop.rollout_with_trainer=true"))
    assert [h["step"] for h in rest] == [3.0, 4.0]
    assert [h["rollout/trainer_restored"] for h in rest] == [1.0, 0.0]
    assert [h["reward/mean"] for h in rest] == [h["reward/mean"] for h in ref[2:]]


@pytest.mark.parametrize("extra, field", [
    (["pool.execution=pool"], "pool.execution"),
    (["async_training.max_policy_lag=1"], "async_training.max_policy_lag"),
    (["train.shard=always"], "train.shard"),
])
def test_settings_it_cannot_honour_are_refused(tmp_path, extra, field):
    with pytest.raises(ConfigError, match=rf"{field}=.*loop.rollout_with_trainer"):
        _cfg("tiny-grpo", tmp_path, 2, "loop.rollout_with_trainer=true", *extra)


def test_a_dedicated_engine_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"lm.deployment.engine='vllm'.*loop.rollout_with_trainer"):
        load_recipe("tiny-grpo-vllm", [f"checkpoint.root={tmp_path}", "loop.rollout_with_trainer=true"])


@pytest.mark.parametrize("extra, expected", [
    ((), True),
    (("loop.rollout_with_trainer=false",), False),
    (("pool.execution=pool",), False),
    (("async_training.max_policy_lag=1", "train.old_logp_source=replay"), False),
    (("train.shard=always",), False),
])
def test_the_default_samples_with_the_trainer_wherever_it_applies(tmp_path, extra, expected):
    assert _cfg("tiny-grpo", tmp_path, 2, *extra).rollout_with_trainer is expected


def test_the_default_leaves_a_dedicated_engine_alone(tmp_path):
    cfg = load_recipe("tiny-grpo-vllm", [f"checkpoint.root={tmp_path}"])
    assert cfg.loop.rollout_with_trainer is None and cfg.rollout_with_trainer is False
