"""GRPO-Guard: golden tests against our transcription (unirl_core/algorithms/grpo_guard.py's docstring):

    c_k = (std_k / |b_k|) / mean_j (std_j / |b_j|)
    l~ = (l - sg(mean_m l)) * c_k,  r~ = exp(l~)
    blocked = (A > 0 and r~ > 1 + eps) or (A < 0 and r~ < 1 - eps)
    entry = -A * w_k * (sg(r) if blocked else r),  w_k = c_k (grad_reweight) or 1
"""

import math

import pytest
import torch

from unirl_core.algorithms.flow_grpo import (
    FlowGRPO,
    FlowGRPOConfig,
    surrogate_per_entry,
)
from unirl_core.algorithms.grpo_guard import (
    GRPOGuard,
    GRPOGuardConfig,
    guarded_surrogate,
    step_scales,
)
from unirl_core.config import load_recipe
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig
from unirl_core.rollout.diffusion import DiffusionEngineConfig, TrainsideDiffusionEngine
from unirl_core.sde import flow_sigmas
from unirl_core.sde.kernels import schedule_coefficients
from unirl_core.types import (
    DiffusionSamplingParams,
    NoiseRecipe,
    PromptRecord,
    SampleBatch,
)

torch.set_num_threads(1)


def test_step_scales_golden():
    b = torch.tensor([-0.1, -0.2, -0.1])
    std = torch.tensor([0.5, 0.2, 0.1])
    # raw = std/|b| = [5, 1, 1]; trained steps 0, 1 -> mean 3 -> [5/3, 1/3]
    torch.testing.assert_close(step_scales(b, std, [0, 1]), torch.tensor([5 / 3, 1 / 3]))
    torch.testing.assert_close(step_scales(b, std, [0, 1, 2]), torch.tensor([15 / 7, 3 / 7, 3 / 7]))


def test_guarded_surrogate_golden():
    # log-ratios 0.3, 0.1, -0.1 (mean 0.1, centred 0.2, 0, -0.2); scale 2 -> l~ = 0.4, 0, -0.4
    new = torch.tensor([0.3, 0.1, -0.1], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -1.0])
    mask = torch.ones(3, dtype=torch.bool)
    per, _, normed = guarded_surrogate(new, old, adv, mask, scale=2.0, clip_range=0.3, adv_clip_max=5.0,
                                           ratio_norm=True, grad_reweight=True)
    torch.testing.assert_close(normed, torch.exp(torch.tensor([0.4, 0.0, -0.4])))
    # entry 0: A>0, r~=e^0.4=1.49 > 1.3 -> blocked; entry 1: r~=1 free; entry 2: A<0, r~=e^-0.4=0.67 < 0.7 blocked
    want = torch.tensor([-2 * math.exp(0.3), -2 * math.exp(0.1), 2 * math.exp(-0.1)])
    torch.testing.assert_close(per, want)
    per.sum().backward()
    torch.testing.assert_close(new.grad, torch.tensor([0.0, -2 * math.exp(0.1), 0.0]))


def test_raw_clip_decision_without_ratio_norm():
    # raw r: e^0.3 = 1.35 > 1.3 blocked (A > 0); e^0.1 free; A < 0 and e^-0.1 = 0.905 > 0.7 free
    new = torch.tensor([0.3, 0.1, -0.1], requires_grad=True)
    per, _, _ = guarded_surrogate(new, torch.zeros(3), torch.tensor([1.0, 1.0, -1.0]), torch.ones(3, dtype=torch.bool),
                                  scale=2.0, clip_range=0.3, adv_clip_max=5.0, ratio_norm=False, grad_reweight=False)
    per.sum().backward()
    torch.testing.assert_close(new.grad, torch.tensor([0.0, -math.exp(0.1), math.exp(-0.1)]))


def test_both_off_gives_flow_grpo_gradient():
    g = torch.Generator().manual_seed(0)
    new0, old = torch.randn(16, generator=g) * 0.3, torch.zeros(16)
    adv = torch.randn(16, generator=g) * 2
    a = new0.clone().requires_grad_(True)
    b = new0.clone().requires_grad_(True)
    guarded_surrogate(a, old, adv, torch.ones(16, dtype=torch.bool), scale=3.0, clip_range=0.2, adv_clip_max=1.5,
                      ratio_norm=False, grad_reweight=False)[0].sum().backward()
    surrogate_per_entry(b, old, adv, clip_range=0.2, adv_clip_max=1.5)[0].sum().backward()
    assert (a.grad != 0).any() and (a.grad == 0).any()  # some entries clipped, some not
    torch.testing.assert_close(a.grad, b.grad)


def _rollout(steps=4):
    bundle = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="full"))
    eng = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=4, decode_media=False))
    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=steps), guidance_scale=1.0, height=32, width=32)
    prompts = [PromptRecord(prompt_id=f"p{i}", prompt=f"prompt {i}") for i in range(1)]
    batch = eng.generate(SampleBatch.from_prompts(prompts, samples_per_prompt=4, kind="diffusion", sampling=sp),
                         noise=NoiseRecipe(base_seed=5))
    for j, s in enumerate(batch):
        s.generated.advantage = float(j % 3) - 1.0
    return bundle, batch


def test_first_update_terms_are_flow_grpo_terms_times_step_scale():
    bundle, batch = _rollout()
    guard = GRPOGuard(GRPOGuardConfig(replay_batch_size=4, clip_range=0.2))
    flow = FlowGRPO(FlowGRPOConfig(replay_batch_size=4, clip_range=0.2))
    g_terms, f_terms = _terms(guard, bundle, batch), _terms(flow, bundle, batch)
    sp = batch.generated[0].sampling
    _, b, std = schedule_coefficients(sp.sde_type, torch.tensor(sp.sigmas), noise_level=sp.noise_level)
    steps = [k for k in range(4) if bool(batch.generated[0].segment.sde_mask[k])]
    c = step_scales(b, std, steps)
    assert len(g_terms) == len(steps) and float(c.max() / c.min()) > 1.5  # the scales really differ
    for gt, ft, ck in zip(g_terms, f_terms, c):
        assert float(gt) == pytest.approx(float(ck) * float(ft), rel=1e-5)
    out = guard.loss(bundle, batch, old_log_probs=None)
    assert out.metrics["guard_ratio_mean"] == 1.0 and out.metrics["guard_clip_frac"] == 0.0


def _terms(algo, bundle, batch):
    gen, out = algo.loss_terms(bundle, batch, old_log_probs=None), []
    while True:
        try:
            out.append(next(gen).detach())
        except StopIteration:
            return out


def test_recipe_selects_grpo_guard():
    cfg = load_recipe("tiny-flow-grpo", ["diffusion.algorithm.name=grpo_guard", "diffusion.algorithm.ratio_norm=false"])
    assert isinstance(cfg.diffusion.algorithm, GRPOGuardConfig) and not cfg.diffusion.algorithm.ratio_norm
