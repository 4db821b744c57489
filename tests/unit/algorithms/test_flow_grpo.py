import math

import pytest
import torch

from unirl_core.algorithms.base import Algorithm, Policy
from unirl_core.algorithms.flow_grpo import (
    FlowGRPO,
    FlowGRPOConfig,
    clipped_surrogate,
    gaussian_kl_same_std,
)
from unirl_core.errors import ConfigError, InvariantError, NumericsError
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig
from unirl_core.rollout.diffusion import DiffusionEngineConfig, TrainsideDiffusionEngine
from unirl_core.sde import flow_sigmas
from unirl_core.types import DiffusionSamplingParams, NoiseRecipe, PromptRecord, SampleBatch

FBS = 4


def test_clipped_surrogate_golden():
    new = torch.tensor([[0.0, math.log(1.5)], [math.log(0.5), 0.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -10.0])  # -10 clamps to -5
    mask = torch.tensor([[True, True], [True, False]])
    loss, ratio = clipped_surrogate(new, old, adv, mask, clip_range=0.2, adv_clip_max=5.0)
    torch.testing.assert_close(ratio, torch.tensor([[1.0, 1.5], [0.5, 1.0]]))
    # entries: A=1,r=1 -> -1; A=1,r=1.5 -> max(-1.5, -1.2) = -1.2; A=-5,r=0.5 -> max(2.5, 4.0) = 4.0
    torch.testing.assert_close(loss, torch.tensor((-1.0 - 1.2 + 4.0) / 3))


def test_gaussian_kl_matches_torch():
    g = torch.Generator().manual_seed(0)
    m, r = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    std = torch.tensor([0.3, 0.5, 0.7]).view(3, 1, 1, 1)
    want = torch.distributions.kl_divergence(torch.distributions.Normal(m, std.expand_as(m)),
                                             torch.distributions.Normal(r, std.expand_as(r))).mean(dim=(1, 2, 3))
    torch.testing.assert_close(gaussian_kl_same_std(m, r, std), want)


def _rollout(dtype="float32", source="tiny-sd3", finetune="lora", n_prompts=2, per=4, guidance=4.5, steps=4,
             ckpt=False):
    bundle = DiffusionBundle.build(DiffusionModelConfig(source=source, dtype=dtype, finetune=finetune,
                                                        gradient_checkpointing=ckpt))
    eng = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=FBS, decode_media=False))
    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=steps), guidance_scale=guidance)
    prompts = [PromptRecord(prompt_id=f"p{i}", prompt=f"prompt {i}") for i in range(n_prompts)]
    batch = eng.generate(SampleBatch.from_prompts(prompts, samples_per_prompt=per, kind="diffusion", sampling=sp),
                         noise=NoiseRecipe(base_seed=11))
    for j, s in enumerate(batch):
        s.generated.advantage = float(j % 3) - 1.0
    return bundle, batch


@pytest.mark.parametrize("dtype,source,finetune,ckpt", [
    ("float32", "tiny-sd3", "lora", False), ("bfloat16", "tiny-sd3", "lora", False),
    ("float32", "tiny-flux", "lora", False), ("bfloat16", "tiny-flux", "lora", False),
    ("bfloat16", "tiny-sd3", "full", True),
])
def test_first_update_ratio_exactly_one(dtype, source, finetune, ckpt):
    bundle, batch = _rollout(dtype, source, finetune=finetune, ckpt=ckpt)
    algo = FlowGRPO(FlowGRPOConfig(replay_batch_size=FBS, kl_beta=0.1))
    assert isinstance(algo, Algorithm) and isinstance(bundle, Policy)
    opt = torch.optim.AdamW([p for p in bundle.module.parameters() if p.requires_grad], lr=1e-2)
    mbs = batch.split(FBS)
    first = algo.loss(bundle, mbs[0], old_log_probs=None)
    m = first.metrics
    assert m["ratio_mean"] == 1.0 and m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0
    assert m["logp_absdiff_mean"] == 0.0 and m["logp_absdiff_max"] == 0.0
    assert m["clip_frac"] == 0.0 and m["kl"] == 0.0
    first.loss.backward()
    opt.step()
    second = algo.loss(bundle, mbs[0], old_log_probs=None).metrics
    assert second["ratio_max"] > 1.0 or second["ratio_min"] < 1.0
    assert second["kl"] > 0.0


def test_replay_source_recomputes_pi_old_over_train_micro_batches():
    bundle, batch = _rollout()
    algo = FlowGRPO(FlowGRPOConfig(old_logp_source="replay", replay_batch_size=3, logp_tolerance=1e-3))
    mbs = batch.split(6)  # other slicing than the engine's forward_batch_size
    olds = [algo.old_log_probs(bundle, mb) for mb in mbs]  # before any update
    for mb, old in zip(mbs, olds):
        m = algo.loss(bundle, mb, old_log_probs=old).metrics
        assert m["ratio_mean"] == 1.0 and m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0
        assert m["logp_absdiff_max"] < 1e-3


def test_fail_closed_on_logp_mismatch():
    bundle, batch = _rollout()
    mb = batch.split(FBS)[0]
    mb.samples[0].generated.segment.log_probs[0] += 0.5  # what a drifting engine would produce
    algo = FlowGRPO(FlowGRPOConfig(replay_batch_size=FBS, logp_tolerance=1e-3))
    with pytest.raises(NumericsError, match="logp_rollout - logp_replay"):
        algo.old_log_probs(bundle, mb)
    assert algo.loss(bundle, mb, old_log_probs=None).metrics["logp_absdiff_max"] == pytest.approx(0.5, rel=1e-5)


def test_timestep_fraction_and_inputs_checked():
    bundle, batch = _rollout(guidance=1.0, steps=6)
    algo = FlowGRPO(FlowGRPOConfig(replay_batch_size=FBS, timestep_fraction=0.5))
    mb = batch.split(FBS)[0]
    old = algo.old_log_probs(bundle, mb)
    assert int((old != 0).any(dim=0).sum()) == 3
    m = algo.loss(bundle, mb, old_log_probs=old).metrics
    assert m["trained_steps"] == 3.0 and m["ratio_mean"] == 1.0
    mb.samples[0].generated.advantage = None
    with pytest.raises(InvariantError, match="advantage"):
        algo.loss(bundle, mb, old_log_probs=None)
    with pytest.raises(ConfigError):
        FlowGRPOConfig(timestep_fraction=0.0)
    with pytest.raises(ConfigError):
        FlowGRPOConfig(old_logp_source="stored")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_replay_survives_the_arrow_boundary(tmp_path, dtype):
    from unirl_core.io import read_batch, write_batch

    bundle, batch = _rollout(dtype)
    write_batch(batch, tmp_path / "rollout.arrow")
    back = read_batch(tmp_path / "rollout.arrow")
    assert back.samples[0].generated.segment.latents.dtype == getattr(torch, dtype)
    m = FlowGRPO(FlowGRPOConfig(replay_batch_size=FBS)).loss(bundle, back.split(FBS)[1], old_log_probs=None).metrics
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["logp_absdiff_max"] == 0.0
