"""CPS step log-probs: ``cps`` follows the public Flow-GRPO code, ``cps_gaussian`` the full Gaussian density.

The reference (``sde_step_with_logprob`` in the flow_grpo repository, ``sde_type='cps'``) averages
``-(x' - mean)^2`` over the non-batch dims; its ``sde`` branch averages the full Gaussian log-density.
``_reference_step`` below is our own float64 transcription of those formulas, written from the math
(x0 = x - s v, eps_hat = x + (1 - s) v, std = s' sin(a pi / 2),
mean = (1 - s') x0 + sqrt(s'^2 - std^2) eps_hat), not from the project code.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from unirl_core.errors import ConfigError, SchemaError
from unirl_core.io import batch_to_table, read_batch, write_batch
from unirl_core.sde import (
    flow_sigmas,
    kernel_coefficients,
    schedule_coefficients,
    sde_step_mask,
    sigmas_tensor,
    squared_distance_log_prob,
    step_is_stochastic,
    step_log_prob,
    transition,
)
from unirl_core.sde.trajectory import denoise_step, sample_trajectory
from unirl_core.types import DiffusionSamplingParams, DiffusionSegment, PromptRecord, SampleBatch
from unirl_core.types.sampling import SDE_TYPES

CPS_TYPES = ("cps", "cps_gaussian")
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _t(v):
    return torch.tensor(v, dtype=torch.float32)


def _reference_step(v, x, prev, sigma, sigma_next, noise_level):
    """float64 ``(mean, std, logp_cps, logp_gaussian)`` of one CPS step; arrays ``[B, ...]``."""
    v, x, prev = (np.asarray(a, dtype=np.float64) for a in (v, x, prev))
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    x0 = x - sigma * v
    eps_hat = x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + math.sqrt(max(sigma_next**2 - std**2, 0.0)) * eps_hat
    sq = (prev - mean) ** 2
    axes = tuple(range(1, sq.ndim))
    lp_cps = -sq.mean(axis=axes)
    lp_gauss = (-sq / (2 * std**2) - math.log(std) - HALF_LOG_2PI).mean(axis=axes)
    return mean, std, lp_cps, lp_gauss


def _replay(kind, v, x, prev, sigma, sigma_next, noise_level, mask=None):
    mask = torch.ones(x.shape[0], dtype=torch.bool) if mask is None else mask
    return transition(kind, v, x, _t(sigma), _t(sigma_next), sde_mask=mask, noise_level=noise_level,
                      sigma_cap=_t(sigma_next), trajectory_dtype=torch.float32, prev_sample=prev)


# -- golden values ------------------------------------------------------------------------------
# 1x1x2x2 latents, s = 0.75, s' = 0.5.
X = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
V = torch.tensor([[[[0.0, 4.0], [-4.0, 8.0]]]])  # x0 = x - 0.75 v = [1, -1, 6, -2]; eps_hat = x + 0.25 v = [1, 3, 2, 6]


def test_golden_noise_level_one():
    # a = 1: std = s' sin(pi/2) = 0.5, sqrt(s'^2 - std^2) = 0, mean = 0.5 x0 = [0.5, -0.5, 3, -1] (exact in fp32).
    prev = torch.tensor([[[[1.5, -0.5], [2.0, -1.0]]]])  # prev - mean = [1, 0, -1, 0]
    cps = _replay("cps", V, X, prev, 0.75, 0.5, 1.0)
    gauss = _replay("cps_gaussian", V, X, prev, 0.75, 0.5, 1.0)
    assert torch.equal(cps.mean, torch.tensor([[[[0.5, -0.5], [3.0, -1.0]]]]))
    assert float(cps.std.reshape(-1)[0]) == 0.5
    # reference: mean of -(d^2) = -(1 + 0 + 1 + 0) / 4
    assert cps.log_prob.tolist() == [-0.5]
    # Gaussian: mean of -d^2 / (2 * 0.25) = -1, minus log 0.5, minus log sqrt(2 pi)
    want = -1.0 - math.log(0.5) - HALF_LOG_2PI  # = -1.2257913526447274
    assert abs(float(gauss.log_prob[0]) - want) < 1e-6
    assert abs(want - (-1.2257913526447274)) < 1e-15


def test_golden_noise_level_one_third():
    # a = 1/3: std = s' sin(pi/6) = 0.25, sqrt(s'^2 - std^2) = sqrt(3)/4,
    # mean = 0.5 x0 + sqrt(3)/4 eps_hat = [0.5 + r, -0.5 + 3r, 3 + 2r, -1 + 6r] with r = sqrt(3)/4.
    r = math.sqrt(3) / 4
    mean_hand = [0.5 + r, -0.5 + 3 * r, 3 + 2 * r, -1 + 6 * r]
    prev = torch.tensor([[[[1.0, 1.0], [4.0, 1.5]]]])
    d = [p - m for p, m in zip([1.0, 1.0, 4.0, 1.5], mean_hand)]
    lp_cps_hand = -sum(di * di for di in d) / 4
    lp_gauss_hand = sum(-di * di / (2 * 0.25**2) for di in d) / 4 - math.log(0.25) - HALF_LOG_2PI
    # the same numbers, pinned: a change of convention or of the transcription shows up here
    assert abs(lp_cps_hand - (-0.018110279185587462)) < 1e-12
    assert abs(lp_gauss_hand - 0.32247359443051815) < 1e-12

    cps = _replay("cps", V, X, prev, 0.75, 0.5, 1 / 3)
    gauss = _replay("cps_gaussian", V, X, prev, 0.75, 0.5, 1 / 3)
    np.testing.assert_allclose(cps.mean.reshape(-1).double().numpy(), mean_hand, atol=1e-6, rtol=0)
    assert abs(float(cps.log_prob[0]) - lp_cps_hand) < 1e-6
    assert abs(float(gauss.log_prob[0]) - lp_gauss_hand) < 1e-5
    _, _, ref_cps, ref_gauss = _reference_step(V, X, prev, 0.75, 0.5, 1 / 3)
    assert abs(float(cps.log_prob[0]) - ref_cps[0]) < 1e-6 and abs(float(gauss.log_prob[0]) - ref_gauss[0]) < 1e-5


@pytest.mark.parametrize("sigma,sigma_next,a", [(0.7, 0.6, 0.7), (1.0, 0.9, 0.5), (0.3, 0.1, 0.9)])
def test_random_batch_matches_reference_transcription(sigma, sigma_next, a):
    g = torch.Generator().manual_seed(7)
    v, x, eps = (torch.randn(3, 4, 5, 5, generator=g) for _ in range(3))
    mean_ref, std_ref, _, _ = _reference_step(v, x, x, sigma, sigma_next, a)
    prev = torch.from_numpy(mean_ref + std_ref * eps.double().numpy()).float()
    _, _, lp_cps, lp_gauss = _reference_step(v, x, prev, sigma, sigma_next, a)
    cps = _replay("cps", v, x, prev, sigma, sigma_next, a)
    gauss = _replay("cps_gaussian", v, x, prev, sigma, sigma_next, a)
    np.testing.assert_allclose(cps.mean.double().numpy(), mean_ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(cps.log_prob.double().numpy(), lp_cps, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(gauss.log_prob.double().numpy(), lp_gauss, atol=1e-5, rtol=1e-5)
    assert cps.log_prob.dtype == torch.float32 and cps.log_prob.shape == (3,)


def test_step_log_prob_dispatch():
    g = torch.Generator().manual_seed(1)
    x, m = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    std = _t(0.3)
    assert torch.equal(step_log_prob("cps", x, m, std), squared_distance_log_prob(x, m))
    want = torch.distributions.Normal(m, std.expand_as(m)).log_prob(x).mean(dim=(1, 2))
    for kind in ("cps_gaussian", "flow", "dance"):
        torch.testing.assert_close(step_log_prob(kind, x, m, std), want)
    with pytest.raises(ConfigError):
        step_log_prob("ode", x, m, std)


# -- the two conventions are not a constant shift apart -----------------------------------------
def test_ratio_differs_between_conventions():
    """Same prev, two policies (old / new velocity): the log-ratios differ by the factor 1 / (2 std^2)."""
    g = torch.Generator().manual_seed(3)
    x, v_old, eps = (torch.randn(2, 4, 6, 6, generator=g) for _ in range(3))
    v_new = v_old + 0.5 * torch.randn(2, 4, 6, 6, generator=g)
    sigma, sigma_next, a = 0.6, 0.5, 0.7
    old = _replay("cps", v_old, x, x, sigma, sigma_next, a)
    prev = old.mean + old.std * eps

    lp = {(kind, pol): _replay(kind, v, x, prev, sigma, sigma_next, a).log_prob
          for kind in CPS_TYPES for pol, v in (("old", v_old), ("new", v_new))}
    log_ratio_cps = (lp["cps", "new"] - lp["cps", "old"]).double()
    log_ratio_gauss = (lp["cps_gaussian", "new"] - lp["cps_gaussian", "old"]).double()
    std = sigma_next * math.sin(a * math.pi / 2)
    scale = 1 / (2 * std**2)
    assert abs(scale - 1) > 0.5  # the factor is far from 1 at this step
    torch.testing.assert_close(log_ratio_gauss, log_ratio_cps * scale, atol=1e-4, rtol=1e-3)
    assert bool((log_ratio_cps.abs() > 1e-3).all())
    # the ratios themselves differ, so one clip range cannot mean the same thing under both
    assert bool(((log_ratio_gauss.exp() - log_ratio_cps.exp()).abs() > 1e-3).all())
    # and the difference between conventions depends on the mean: not a constant shift
    shift_old = lp["cps_gaussian", "old"] - lp["cps", "old"]
    shift_new = lp["cps_gaussian", "new"] - lp["cps", "new"]
    assert bool(((shift_new - shift_old).abs() > 1e-3).all())


def test_cps_and_cps_gaussian_share_the_transition():
    sig = sigmas_tensor(flow_sigmas(num_steps=6))
    a, b = (schedule_coefficients(k, sig, noise_level=0.7) for k in CPS_TYPES)
    for ca, cb in zip(a, b):
        assert torch.equal(torch.as_tensor(ca), torch.as_tensor(cb))
    for k in range(6):
        one = kernel_coefficients("cps_gaussian", sig[k], sig[k + 1], noise_level=0.7, sigma_cap=sig[1])
        for col, val in zip(b, one):
            assert torch.equal(torch.as_tensor(col[k]), torch.as_tensor(val))
    for kind in CPS_TYPES:
        assert not step_is_stochastic(kind, 0.7, 0.0) and step_is_stochastic(kind, 0.7, 0.1)
        assert not step_is_stochastic(kind, 0.0, 0.5)
        mask = sde_step_mask(DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=6), sde_type=kind))
        assert bool(mask[:-1].all()) and not bool(mask[-1])


# -- rollout -> replay is exact under both conventions ------------------------------------------
@pytest.mark.parametrize("kind", CPS_TYPES)
@pytest.mark.parametrize("mask", [[True, True, True], [True, False, True]])
def test_transition_rollout_replay_bitwise(kind, mask):
    g = torch.Generator().manual_seed(11)
    v, x, eps = (torch.randn(3, 4, 5, 5, generator=g) for _ in range(3))
    x = x.bfloat16().float()
    kw = dict(sde_mask=torch.tensor(mask), noise_level=0.7, sigma_cap=_t(0.9), trajectory_dtype=torch.bfloat16)
    out = transition(kind, v, x, _t(0.7), _t(0.6), noise=eps, **kw)
    assert torch.equal(out.prev_sample, out.prev_sample.bfloat16().float())
    stored = out.prev_sample.bfloat16()
    rep = transition(kind, v, x, _t(0.7), _t(0.6), prev_sample=stored, **kw)
    assert torch.equal(rep.log_prob, out.log_prob)
    sde = torch.tensor(mask)
    assert bool((out.log_prob[~sde] == 0).all()) and bool((out.log_prob[sde] != 0).all())
    # the log-prob is taken of the stored (rounded) state, in this kind's convention
    want = step_log_prob(kind, stored.float(), out.mean, out.std.expand(3, 1, 1, 1))
    assert torch.equal(out.log_prob[sde], want[sde])


def _velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * (1 + sigma) - 0.3 * x


@pytest.mark.parametrize("kind", CPS_TYPES)
def test_trajectory_rollout_replay_bitwise(kind):
    steps, b = 6, 3
    sig = sigmas_tensor(flow_sigmas(num_steps=steps))
    g = torch.Generator().manual_seed(5)
    x_T = torch.randn(b, 4, 6, 6, generator=g)
    noises = [torch.randn(b, 4, 6, 6, generator=g) for _ in range(steps)]
    smask = torch.ones(b, steps, dtype=torch.bool)
    smask[1, :2] = False
    smask[:, -1] = False  # the final CPS step is deterministic
    traj = sample_trajectory(_velocity, x_T, sig, sde_type=kind, noise_level=0.7, sde_mask=smask,
                             trajectory_dtype=torch.bfloat16, noise_fn=lambda k: noises[k])
    coefs = schedule_coefficients(kind, sig, noise_level=0.7)
    for k in range(steps):
        rep = denoise_step(_velocity, traj.latents[:, k].float(), k, sig, sde_type=kind, noise_level=0.7,
                           sde_mask_k=smask[:, k], trajectory_dtype=torch.bfloat16,
                           prev_sample=traj.latents[:, k + 1], coefficients=coefs)
        assert torch.equal(rep.log_prob, traj.log_probs[:, k]), k
    assert bool((traj.log_probs[~smask] == 0).all()) and bool((traj.log_probs[smask] != 0).all())


def test_trajectories_identical_only_log_probs_differ():
    steps = 5
    sig = sigmas_tensor(flow_sigmas(num_steps=steps))
    g = torch.Generator().manual_seed(9)
    x_T = torch.randn(2, 4, 6, 6, generator=g)
    noises = [torch.randn(2, 4, 6, 6, generator=g) for _ in range(steps)]
    smask = torch.ones(2, steps, dtype=torch.bool)
    smask[:, -1] = False
    trajs = {kind: sample_trajectory(_velocity, x_T, sig, sde_type=kind, noise_level=0.7, sde_mask=smask,
                                     trajectory_dtype=torch.float32, noise_fn=lambda k: noises[k])
             for kind in CPS_TYPES}
    assert torch.equal(trajs["cps"].latents, trajs["cps_gaussian"].latents)
    # per SDE step: gaussian = cps / (2 std^2) - log std - log sqrt(2 pi)
    std = (sig[1:steps] * math.sin(0.7 * math.pi / 2)).double()
    want = trajs["cps"].log_probs[:, :-1].double() / (2 * std**2) - torch.log(std) - HALF_LOG_2PI
    torch.testing.assert_close(trajs["cps_gaussian"].log_probs[:, :-1].double(), want, atol=1e-4, rtol=1e-5)


# -- the kernel name is pinned on the Part and survives Arrow ----------------------------------
def _batch(kind: str) -> SampleBatch:
    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=3), sde_type=kind)
    b = SampleBatch.from_prompts([PromptRecord(prompt_id="p0", prompt="a cat")], samples_per_prompt=2,
                                 kind="diffusion", sampling=sp)
    for s in b:
        s.generated.segment = DiffusionSegment(latents=torch.zeros(4, 2, 2, 2), log_probs=torch.zeros(3),
                                               sigmas=torch.tensor(sp.sigmas), sde_mask=torch.ones(3, dtype=bool))
    return b


def test_sde_types_enumerated():
    assert "cps" in SDE_TYPES and "cps_gaussian" in SDE_TYPES


@pytest.mark.parametrize("kind", CPS_TYPES)
def test_sde_type_round_trips_through_arrow(tmp_path, kind):
    got = read_batch(write_batch(_batch(kind), tmp_path / "b.arrow"))
    assert [p.sampling.sde_type for p in got.generated] == [kind, kind]


def test_damaged_sde_type_is_rejected(tmp_path):
    t = batch_to_table(_batch("cps_gaussian"))
    col = t.column("sampling").to_pylist()
    bad = []
    for text in col:
        d = json.loads(text)
        d["sde_type"] = "cps_gauss"
        bad.append(json.dumps(d))
    t = t.set_column(t.schema.get_field_index("sampling"), "sampling", pa.array(bad, pa.string()))
    path = tmp_path / "bad.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    with pytest.raises(SchemaError, match=r"bad.arrow: row 0 .*sde_type"):
        read_batch(path)
    with pytest.raises(ConfigError):
        DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=3), sde_type="cps_gauss")
