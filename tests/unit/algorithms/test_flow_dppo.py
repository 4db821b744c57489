"""Flow-DPPO: golden tests against our formulation (unirl_core/algorithms/flow_dppo.py's docstring):

    KL = mean_elements |m_new - m_old|^2 / (2 std^2),  r = exp(logp_new - logp_old)
    blocked = KL > kl_bound and A (r - 1) > 0
    entry = -A (sg(r) if blocked else r)
"""

import math

import pytest
import torch

from unirl_core.algorithms.flow_dppo import (
    FlowDPPO,
    FlowDPPOConfig,
    trust_region_surrogate,
)
from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError, InvariantError
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig
from unirl_core.rollout.diffusion import DiffusionEngineConfig, TrainsideDiffusionEngine
from unirl_core.sde import flow_sigmas
from unirl_core.types import (
    DiffusionSamplingParams,
    NoiseRecipe,
    PromptRecord,
    SampleBatch,
)

torch.set_num_threads(1)


def test_trust_region_surrogate_golden():
    new = torch.tensor([0.2, 0.2, -0.2, -0.2, 0.2], requires_grad=True)
    old = torch.zeros(5)
    adv = torch.tensor([1.0, 1.0, -2.0, 1.0, 9.0])  # 9 clamps to 5
    kl = torch.tensor([0.5, 0.01, 0.5, 0.5, 0.01])
    per, _, blocked = trust_region_surrogate(new, old, adv, kl, kl_bound=0.1, adv_clip_max=5.0)
    # 0: KL past the bound, A > 0 and r > 1 -> blocked; 1: inside the ball; 2: A < 0 and r < 1 (favoured), past
    # the bound -> blocked; 3: A > 0 but r < 1 (moving back) -> free; 4: inside the ball
    assert blocked.tolist() == [True, False, True, False, False]
    e, f = math.exp(0.2), math.exp(-0.2)
    torch.testing.assert_close(per, torch.tensor([-e, -e, 2 * f, -f, -5 * e]))
    per.sum().backward()
    torch.testing.assert_close(new.grad, torch.tensor([0.0, -e, 0.0, -f, -5 * e]))


def _rollout():
    bundle = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="full"))
    eng = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=4, decode_media=False))
    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=4), guidance_scale=1.0, height=32, width=32)
    prompts = [PromptRecord(prompt_id="p0", prompt="prompt 0")]
    batch = eng.generate(SampleBatch.from_prompts(prompts, samples_per_prompt=4, kind="diffusion", sampling=sp),
                         noise=NoiseRecipe(base_seed=5))
    for j, s in enumerate(batch):
        s.generated.advantage = [1.0, -1.0, 0.5, -0.5][j]
    return bundle, batch


def _grads(bundle):
    return torch.cat([p.grad.flatten() for p in bundle.module.parameters() if p.grad is not None])


def test_first_update_exact_then_the_trust_region_acts():
    bundle, batch = _rollout()
    algo = FlowDPPO(FlowDPPOConfig(kl_bound=1e-12))
    old = algo.old_log_probs(bundle, batch)
    first = algo.loss(bundle, batch, old_log_probs=old)
    m = first.metrics
    assert m["step_kl_max"] == 0.0 and m["trust_region_block_frac"] == 0.0 and m["ratio_max"] == 1.0
    first.loss.backward()
    with torch.no_grad():
        for p in bundle.module.parameters():
            if p.grad is not None:
                p -= 1e-2 * p.grad.sign()
                p.grad = None
    second = algo.loss(bundle, batch, old_log_probs=old).metrics
    assert second["step_kl_mean"] > 0.0 and 0.0 < second["trust_region_block_frac"] < 1.0
    # a ball too large to reach: the gradient is the unclipped PPO one (Flow-GRPO with a huge clip range)
    wide = FlowDPPO(FlowDPPOConfig(kl_bound=1e9))
    wide._old_means = dict(algo._old_means)  # the same pi_old (its replay now would fail the tolerance)
    out = wide.loss(bundle, batch, old_log_probs=old)
    assert out.metrics["trust_region_block_frac"] == 0.0
    out.loss.backward()
    g_dppo = _grads(bundle)
    bundle.module.zero_grad(set_to_none=True)
    FlowGRPO(FlowGRPOConfig(clip_range=1e9, old_logp_source="replay")).loss(bundle, batch, old_log_probs=old).loss.backward()
    torch.testing.assert_close(g_dppo, _grads(bundle))


def test_missing_means_and_config_errors_name_the_fix(tmp_path):
    bundle, batch = _rollout()
    with pytest.raises(InvariantError, match="old_logp_source: replay"):
        FlowDPPO(FlowDPPOConfig()).loss(bundle, batch, old_log_probs=None)
    with pytest.raises(ConfigError, match="flow_dppo.kl_bound"):
        FlowDPPOConfig(kl_bound=0.0)
    with pytest.raises(ConfigError, match="flow_dppo.old_logp_source"):
        FlowDPPOConfig(old_logp_source="rollout")
    with pytest.raises(ConfigError, match="clip_range"):
        load_recipe("tiny-flow-dppo", ["diffusion.algorithm.clip_range=0.2"])
    cfg = load_recipe("tiny-flow-dppo", [f"checkpoint.root={tmp_path}"])
    assert isinstance(cfg.diffusion.algorithm, FlowDPPOConfig) and cfg.train.num_updates_per_batch == 2
