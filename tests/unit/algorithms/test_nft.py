"""DiffusionNFT: golden tests against our transcription of arXiv 2509.16117, and the algorithm on tiny SD3.

Transcription (rectified flow, x_t = (1 - t) x0 + t eps, target v = eps - x0):
    v+ = (1 - beta) v_old + beta v_theta,   v- = (1 + beta) v_old - beta v_theta
    r  = 1/2 + 1/2 clip(A / Z, -1, 1)
    L  = r mean|v+ - v|^2 + (1 - r) mean|v- - v|^2
Stationary point in v_theta (d L / d v_theta = 0, derived by hand):
    r beta (v+ - v) = (1 - r) beta (v- - v)  =>  v_theta* = v_old + (2 r - 1) (v - v_old) / beta.
"""

import pytest
import torch

from unirl_core.algorithms.nft import (
    DiffusionNFT,
    DiffusionNFTConfig,
    nft_loss_per_sample,
    optimality_reward,
    renoise,
)
from unirl_core.algorithms.registry import algorithm_names
from unirl_core.errors import ConfigError, InvariantError
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig
from unirl_core.rollout.diffusion import DiffusionEngineConfig, TrainsideDiffusionEngine
from unirl_core.sde import flow_sigmas
from unirl_core.train.backend import TrainBackend
from unirl_core.train.config import TrainConfig
from unirl_core.types import (
    DiffusionSamplingParams,
    NoiseRecipe,
    PromptRecord,
    SampleBatch,
)

torch.set_num_threads(1)


def test_optimality_reward_and_renoise_golden():
    adv = torch.tensor([-3.0, -0.5, 0.0, 0.4, 2.0])
    torch.testing.assert_close(optimality_reward(adv, 1.0), torch.tensor([0.0, 0.25, 0.5, 0.7, 1.0]))
    torch.testing.assert_close(optimality_reward(adv, 2.0), torch.tensor([0.0, 0.375, 0.5, 0.6, 1.0]))
    x0, eps = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0])
    x_t, v = renoise(x0, eps, 0.25)
    torch.testing.assert_close(x_t, torch.tensor([0.75 * 2.0 + 0.25 * 0.5, 0.75 * -1.0 + 0.25 * 1.0]))
    torch.testing.assert_close(v, torch.tensor([-1.5, 2.0]))


def test_loss_golden_hand_computed():
    # one sample, two elements; beta = 0.5, r = 0.75
    v_theta, v_old, v = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([[1.0, 1.0]])
    # v+ = 0.5*[0,2] + 0.5*[1,0] = [0.5, 1.0];  |v+ - v|^2 mean = (0.25 + 0) / 2 = 0.125
    # v- = 1.5*[0,2] - 0.5*[1,0] = [-0.5, 3.0]; |v- - v|^2 mean = (2.25 + 4) / 2 = 3.125
    got = nft_loss_per_sample(v_theta, v_old, v, torch.tensor([0.75]), 0.5)
    torch.testing.assert_close(got, torch.tensor([0.75 * 0.125 + 0.25 * 3.125]))


@pytest.mark.parametrize("r,beta", [(0.9, 1.0), (0.2, 1.0), (0.7, 0.3), (0.5, 2.0)])
def test_minimiser_is_v_old_plus_scaled_reinforcement_direction(r, beta):
    g = torch.Generator().manual_seed(0)
    v_old, v = torch.randn(1, 6, generator=g), torch.randn(1, 6, generator=g)
    theta = torch.zeros(1, 6, requires_grad=True)
    opt = torch.optim.SGD([theta], lr=0.5 / max(beta, 1.0) ** 2)
    for _ in range(2000):
        opt.zero_grad()
        nft_loss_per_sample(theta, v_old, v, torch.tensor([r]), beta).sum().backward()
        opt.step()
    torch.testing.assert_close(theta.detach(), v_old + (2 * r - 1) * (v - v_old) / beta, atol=1e-4, rtol=1e-4)


def test_config_errors_name_the_field():
    for kw, fld in (({"beta": 0.0}, "nft.beta"), ({"reward_scale": -1.0}, "nft.reward_scale"),
                    ({"timestep_fraction": 0.0}, "nft.timestep_fraction"), ({"old_logp_source": "rollout"},
                                                                            "nft.old_logp_source")):
        with pytest.raises(ConfigError, match=fld):
            DiffusionNFTConfig(**kw)
    assert "nft" in algorithm_names("diffusion")


def _ode_rollout(n_prompts=2, per=4, steps=4, finetune="full", guidance=1.0):
    bundle = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune=finetune))
    eng = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=4, decode_media=False))
    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=steps), sde_type="ode", guidance_scale=guidance,
                                 height=32, width=32)
    prompts = [PromptRecord(prompt_id=f"p{i}", prompt=f"prompt {i}") for i in range(n_prompts)]
    batch = eng.generate(SampleBatch.from_prompts(prompts, samples_per_prompt=per, kind="diffusion", sampling=sp),
                         noise=NoiseRecipe(base_seed=3))
    for j, s in enumerate(batch):
        s.generated.advantage = float(j % 3) - 1.0
    return bundle, batch


def test_ode_rollout_trains_first_update_v_old_equals_v_theta_and_terms_add_up():
    bundle, batch = _ode_rollout(guidance=3.0)  # CFG-sampled rollout: NFT trains the conditional velocity
    assert not any(bool(p.segment.sde_mask.any()) for p in batch.generated)  # ODE: no SDE step, no log-prob
    algo = DiffusionNFT(DiffusionNFTConfig(old_policy="policy", replay_batch_size=3, timestep_fraction=0.5))
    with torch.no_grad():
        v_old = algo.old_log_probs(bundle, batch)
    assert v_old.shape == (8, 2, 4, 4, 4)
    assert torch.equal(v_old, algo.old_log_probs(bundle, batch))  # re-noising is seeded: same points
    out = algo.loss(bundle, batch, old_log_probs=v_old)
    m = out.metrics
    assert m["v_old_absdiff_max"] == 0.0 and m["trained_steps"] == 2.0
    # with v_theta == v_old both implicit policies equal v_old: the loss is the plain flow-matching error
    assert m["nft_pos_mse"] == pytest.approx(m["nft_neg_mse"]) and out.loss.item() == pytest.approx(m["nft_pos_mse"])
    assert algo.num_loss_terms(batch) == 3 * 2
    terms = list(_drain(algo.loss_terms(bundle, batch, old_log_probs=v_old)))
    assert len(terms) == 6 and float(sum(terms)) == pytest.approx(float(out.loss), rel=1e-6)
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bundle.module.parameters())


def _drain(gen):
    while True:
        try:
            yield next(gen)
        except StopIteration:
            return


def test_missing_or_mismatched_v_old_fails_with_the_fix():
    bundle, batch = _ode_rollout(n_prompts=1)
    algo = DiffusionNFT(DiffusionNFTConfig(old_policy="policy"))
    with pytest.raises(InvariantError, match="old_logp_source: replay"):
        algo.loss(bundle, batch, old_log_probs=None)
    with pytest.raises(InvariantError, match="shape"):
        algo.loss(bundle, batch, old_log_probs=torch.zeros(4, 1, 4, 4, 4))


def test_backend_evaluates_v_old_under_the_ema_weights():
    bundle, batch = _ode_rollout(n_prompts=1)
    algo = DiffusionNFT(DiffusionNFTConfig(old_policy="ema"))
    backend = TrainBackend(bundle, algo, TrainConfig(lr=1e-2, micro_batch_size=4, old_logp_source="replay",
                                                     ema_decay=0.5))
    backend.step(batch)  # weights move; the EMA is half-way
    (v_old,) = backend._freeze_old_log_probs(batch.split(4))
    with torch.no_grad():
        with backend.ema_applied():
            want = algo.old_log_probs(bundle, batch)
        policy_v = algo.old_log_probs(bundle, batch)
    assert torch.equal(v_old, want) and not torch.equal(v_old, policy_v)
