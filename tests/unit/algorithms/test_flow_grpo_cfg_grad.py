"""Which CFG branch of SD3's batched [uncond; cond] forward carries Flow-GRPO's gradient (cfg_grad).

With v = v_u + g (v_c - v_u) = (1 - g) v_u + g v_c, the gradient reaching the transformer's uncond rows
is exactly (1 - g) / g times the one reaching its cond rows with ``cfg_grad: both``. The default, like the public
Flow-GRPO reference's training-time log-prob recomputation, detaches the uncond half (algorithms README).
"""

import torch

from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig, stack_conditions
from unirl_core.rollout.diffusion import DiffusionEngineConfig, TrainsideDiffusionEngine
from unirl_core.sde import flow_sigmas
from unirl_core.types import DiffusionSamplingParams, NoiseRecipe, PromptRecord, SampleBatch

FBS, G = 4, 4.5


def _rollout(bundle=None):
    """A tiny SD3 LoRA bundle (or ``bundle``) and a CFG 4.5 rollout of 2 prompts x 2 samples with set advantages."""
    bundle = bundle or DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="lora"))
    eng = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=FBS, decode_media=False))
    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=4), guidance_scale=G)
    prompts = [PromptRecord(prompt_id=f"p{i}", prompt=f"prompt {i}") for i in range(2)]
    batch = eng.generate(SampleBatch.from_prompts(prompts, samples_per_prompt=2, kind="diffusion", sampling=sp),
                         noise=NoiseRecipe(base_seed=3))
    for j, s in enumerate(batch):
        s.generated.advantage = float(j % 3) - 1.0
    return bundle, batch


def _lora_grads(bundle, batch, *, detach_uncond=False, cfg_grad="both"):
    """LoRA gradients of one Flow-GRPO loss; records the gradient at the transformer's output rows."""
    seen = []

    def hook(_mod, _args, output):
        out = output[0]
        out.register_hook(lambda g: seen.append(g.detach().clone()))
        if detach_uncond:  # what a loss that stops gradient at the uncond branch would see
            n = out.shape[0] // 2
            out = torch.cat([out[:n].detach(), out[n:]])
        return (out, *output[1:])

    handle = bundle.module.register_forward_hook(hook)
    try:
        bundle.module.zero_grad(set_to_none=True)
        FlowGRPO(FlowGRPOConfig(replay_batch_size=FBS, clip_range=1.0, cfg_grad=cfg_grad)) \
            .loss(bundle, batch, old_log_probs=None).loss.backward()
    finally:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in bundle.module.named_parameters() if p.requires_grad}
    return grads, seen


def test_default_stops_gradient_at_the_uncond_branch_like_the_reference():
    bundle, batch = _rollout()
    default, seen = _lora_grads(bundle, batch, cfg_grad=FlowGRPOConfig().cfg_grad)
    assert seen and all(g.chunk(2)[0].abs().sum() == 0 and g.chunk(2)[1].abs().sum() > 0 for g in seen)
    # the same gradient a hook that detaches the uncond rows gives
    hooked, _ = _lora_grads(bundle, batch, detach_uncond=True)
    for n in default:
        torch.testing.assert_close(default[n], hooked[n], rtol=1e-6, atol=1e-12)


def test_replay_gradient_reaches_both_cfg_branches_when_asked():
    bundle, batch = _rollout()
    _, seen = _lora_grads(bundle, batch)
    assert seen  # one batched forward of 2B per trained step
    for g in seen:
        assert g.shape[0] == 2 * len(batch)
        g_u, g_c = g.chunk(2)
        assert g_u.abs().sum() > 0 and g_c.abs().sum() > 0
        torch.testing.assert_close(g_u, (1 - G) / G * g_c, rtol=1e-5, atol=1e-12)


def test_negative_condition_embeddings_receive_gradient():
    bundle, batch = _rollout()
    parts = batch.generated
    conds = {k: v.detach().clone().requires_grad_(True)
             for k, v in stack_conditions([p.conditions for p in parts], bundle.device).items()}
    x = torch.stack([p.segment.latents[1] for p in parts]).float()
    v = bundle.guided_velocity(x, torch.tensor(0.7), bundle.prepare_cfg(conds, guidance_scale=G), guidance_scale=G)
    grads = torch.autograd.grad(v.square().sum(), [conds["negative_prompt_embeds"], conds["prompt_embeds"],
                                                  conds["negative_pooled_prompt_embeds"]])
    assert all(g.abs().sum() > 0 for g in grads)


def test_detaching_uncond_changes_the_lora_gradient():
    bundle, batch = _rollout()
    both, _ = _lora_grads(bundle, batch)
    cond_only, seen = _lora_grads(bundle, batch, detach_uncond=True)
    assert all(g.chunk(2)[0].abs().sum() == 0 for g in seen)
    diff = sum((both[n] - cond_only[n]).abs().sum() for n in both)
    assert diff > 1e-3 * sum(g.abs().sum() for g in both.values())
