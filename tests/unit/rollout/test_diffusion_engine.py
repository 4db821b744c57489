import hashlib

import pytest
import torch

from unirl_core.errors import EngineError
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig
from unirl_core.rollout.base import RolloutEngine
from unirl_core.rollout.diffusion import DiffusionEngineConfig, TrainsideDiffusionEngine
from unirl_core.rollout.sigma_verify import verify_batch_sigmas
from unirl_core.sde import flow_sigmas, initial_noise
from unirl_core.types import DiffusionSamplingParams, NoiseRecipe, PromptRecord, SampleBatch

STEPS = 4


@pytest.fixture(scope="module")
def bundle():
    return DiffusionBundle.build(DiffusionModelConfig())


def _request(n_prompts=2, per=3, **kw):
    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=STEPS), **kw)
    prompts = [PromptRecord(prompt_id=f"p{i}", prompt=f"a red cube {i}") for i in range(n_prompts)]
    return SampleBatch.from_prompts(prompts, samples_per_prompt=per, kind="diffusion", sampling=sp)


def _digest(batch):
    h = hashlib.sha256()
    for s in batch.samples:
        h.update(s.generated.segment.latents.float().numpy().tobytes())
        h.update(s.generated.segment.log_probs.numpy().tobytes())
    return h.hexdigest()


def test_generate_fills_parts(bundle):
    eng = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=4), policy_version=3)
    assert isinstance(eng, RolloutEngine)
    req = _request()
    out = eng.generate(req, noise=NoiseRecipe(base_seed=5))
    assert [s.sample_id for s in out] == [s.sample_id for s in req]
    assert req.samples[0].generated.segment is None  # the request is not mutated
    for s in out:
        p = s.generated
        seg = p.segment
        assert seg.latents.shape == (STEPS + 1, 4, 8, 8) and seg.latents.dtype == torch.float32
        assert seg.log_probs.shape == (STEPS,) and bool(seg.sde_mask.all()) and bool((seg.log_probs != 0).all())
        assert set(p.conditions) == {"prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                                     "negative_pooled_prompt_embeds"}
        assert p.conditions["prompt_embeds"].ndim == 2 and p.media[:4] == b"\x89PNG" and p.policy_version == 3
    verify_batch_sigmas(out)
    # x_T is the NoiseRecipe's draw, bit for bit
    want = initial_noise(NoiseRecipe(base_seed=5), [s.group_id for s in out], (4, 8, 8))
    assert torch.equal(torch.stack([s.generated.segment.latents[0] for s in out]), want)


def test_same_recipe_same_trajectories_and_slicing_keeps_noise(bundle):
    req = _request()
    a = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=6)).generate(req, noise=NoiseRecipe(base_seed=1))
    b = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=6)).generate(req, noise=NoiseRecipe(base_seed=1))
    c = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=2)).generate(req, noise=NoiseRecipe(base_seed=1))
    assert _digest(a) == _digest(b)
    for sa, sc in zip(a, c):
        assert torch.equal(sa.generated.segment.latents[0], sc.generated.segment.latents[0])
        torch.testing.assert_close(sa.generated.segment.latents, sc.generated.segment.latents, atol=1e-4, rtol=1e-4)
    d = TrainsideDiffusionEngine(bundle).generate(req, noise=NoiseRecipe(base_seed=2))
    assert _digest(a) != _digest(d)


def test_cfg_off_window_and_bf16_trajectory(bundle):
    req = _request(guidance_scale=1.0, sde_window_size=2, sde_window_range=(0, 2))
    eng = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(trajectory_dtype="bfloat16", decode_media=False))
    out = eng.generate(req, noise=NoiseRecipe(base_seed=0))
    groups = out.groups()
    for idx in groups.values():
        masks = [out.samples[i].generated.segment.sde_mask for i in idx]
        assert all(torch.equal(m, masks[0]) for m in masks) and int(masks[0].sum()) == 2
    for s in out:
        seg = s.generated.segment
        assert seg.latents.dtype == torch.bfloat16 and s.generated.media is None
        assert set(s.generated.conditions) == {"prompt_embeds", "pooled_prompt_embeds"}
        assert bool((seg.log_probs[~seg.sde_mask] == 0).all()) and bool((seg.log_probs[seg.sde_mask] != 0).all())


def test_ode_and_same_noise_per_group(bundle):
    out = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(decode_media=False)).generate(
        _request(sde_type="ode", guidance_scale=1.0), noise=NoiseRecipe(base_seed=0, same_noise_per_group=True))
    a, b = out.samples[0].generated.segment, out.samples[1].generated.segment
    assert not bool(a.sde_mask.any()) and torch.equal(a.latents, b.latents)


def test_mixed_sampling_params_fail_loudly(bundle):
    a, b = _request(n_prompts=1), _request(n_prompts=1, guidance_scale=2.0)
    b.samples[0].sample_id = "other"
    for p in b.samples[0].parts:
        p.sample_id = "other"
    mixed = SampleBatch(samples=[a.samples[0], b.samples[0]])
    with pytest.raises(EngineError, match="sampling"):
        TrainsideDiffusionEngine(bundle).generate(mixed)
    ar = SampleBatch.from_prompts([PromptRecord(prompt_id="q", prompt="x")], samples_per_prompt=1, kind="ar",
                                  sampling=None)
    with pytest.raises(EngineError, match="diffusion"):
        TrainsideDiffusionEngine(bundle).generate(ar)


def test_prompt_enhancement_parent_text_conditions_the_image(bundle):
    from unirl_core.types import Part, Sample

    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=STEPS), guidance_scale=1.0)

    def chained(sid, parent_text):
        ar = Part(kind="ar", sample_id=sid, group_id="g", prompt="cube", text=parent_text)
        img = Part(kind="diffusion", sample_id=sid, group_id="g", parent=0, prompt="cube", sampling=sp)
        return Sample(sample_id=sid, group_id="g", parts=[ar, img])

    eng = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(decode_media=False))
    out = eng.generate(SampleBatch(samples=[chained("a", "a shiny red cube on grass")]))
    want = bundle.encode_text(["a shiny red cube on grass"])[0]["prompt_embeds"]
    assert torch.equal(out.samples[0].generated.conditions["prompt_embeds"], want)
    assert out.samples[0].parts[0].segment is None and out.samples[0].parts[1].segment is not None
    with pytest.raises(EngineError, match="AR stage"):
        eng.generate(SampleBatch(samples=[chained("b", None)]))
