"""Kernels vs torch.distributions.Normal and vs the papers' formulas written independently in float64."""

import math

import numpy as np
import pytest
import torch

from unirl_core.errors import InvariantError
from unirl_core.sde import cps_mean_std, dance_mean_std, flow_mean_std, gaussian_log_prob, ode_mean, transition

SIGMA, SIGMA_NEXT, A = 0.7, 0.6, 0.7


def _inputs(seed=0, shape=(3, 4, 5, 5)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _t(v):
    return torch.tensor(v, dtype=torch.float32)


def _np(t):
    return t.double().numpy()


def _paper_logp(x, mean, std):
    lp = -((x - mean) ** 2) / (2 * std**2) - np.log(std) - 0.5 * np.log(2 * np.pi)
    return lp.reshape(lp.shape[0], -1).mean(axis=1)


def _check_against_normal(mean, std, x):
    want = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).mean(dim=(1, 2, 3))
    torch.testing.assert_close(gaussian_log_prob(x, mean, std), want)


def test_flow_grpo_sde_matches_paper_eq():
    v, x, eps = _inputs()
    mean, std = flow_mean_std(v, x, _t(SIGMA), _t(SIGMA_NEXT), noise_level=A, sigma_cap=_t(0.9))
    # Flow-GRPO: x' = x + [v + s_t^2/(2t) (x + (1-t) v)] dt + s_t sqrt(|dt|) eps, s_t = a sqrt(t/(1-t))
    t, dt = SIGMA, SIGMA_NEXT - SIGMA
    s_t = A * math.sqrt(t / (1 - t))
    vn, xn = _np(v), _np(x)
    want_mean = xn + (vn + s_t**2 / (2 * t) * (xn + (1 - t) * vn)) * dt
    want_std = s_t * math.sqrt(-dt)
    np.testing.assert_allclose(_np(mean), want_mean, atol=1e-5, rtol=0)
    assert abs(float(std) - want_std) < 1e-6
    prev = mean + std * eps
    np.testing.assert_allclose(_np(gaussian_log_prob(prev, mean, std)), _paper_logp(_np(prev), want_mean, want_std),
                               atol=1e-5, rtol=1e-5)
    _check_against_normal(mean, std, prev)


def test_flow_grpo_sde_caps_sigma_one():
    v, x, _ = _inputs()
    _, std = flow_mean_std(v, x, _t(1.0), _t(0.9), noise_level=A, sigma_cap=_t(0.9))
    assert torch.isfinite(std) and abs(float(std) - A * math.sqrt(1.0 / 0.1) * math.sqrt(0.1)) < 1e-5


def test_dance_grpo_sde_matches_paper():
    v, x, eps = _inputs(1)
    mean, std = dance_mean_std(v, x, _t(SIGMA), _t(SIGMA_NEXT), noise_level=A)
    # DanceGRPO: x' = x + [v - eta^2/2 * score] dsigma + eta sqrt(sigma - sigma') eps, score = -(x - (1-s) x0) / s^2
    s, ds = SIGMA, SIGMA_NEXT - SIGMA
    vn, xn = _np(v), _np(x)
    x0 = xn - s * vn
    score = -(xn - (1 - s) * x0) / s**2
    want_mean = xn + (vn - 0.5 * A**2 * score) * ds
    want_std = A * math.sqrt(-ds)
    np.testing.assert_allclose(_np(mean), want_mean, atol=1e-5, rtol=0)
    assert abs(float(std) - want_std) < 1e-6
    prev = mean + std * eps
    np.testing.assert_allclose(_np(gaussian_log_prob(prev, mean, std)), _paper_logp(_np(prev), want_mean, want_std),
                               atol=1e-5, rtol=1e-5)
    _check_against_normal(mean, std, prev)


def test_cps_preserves_coefficients():
    v, x, eps = _inputs(2)
    mean, std = cps_mean_std(v, x, _t(SIGMA), _t(SIGMA_NEXT), noise_level=A)
    s, s2 = SIGMA, SIGMA_NEXT
    vn, xn = _np(v), _np(x)
    std_want = s2 * math.sin(A * math.pi / 2)
    x0, e = xn - s * vn, xn + (1 - s) * vn
    want_mean = (1 - s2) * x0 + math.sqrt(s2**2 - std_want**2) * e
    np.testing.assert_allclose(_np(mean), want_mean, atol=1e-5, rtol=0)
    # the noise coefficients sum in quadrature to sigma_next: the marginal keeps its form
    assert abs((s2**2 - std_want**2) + std_want**2 - s2**2) < 1e-12
    prev = mean + std * eps
    _check_against_normal(mean, _t(float(std)), prev)


def test_ode_is_euler():
    v, x, _ = _inputs(3)
    torch.testing.assert_close(ode_mean(v, x, _t(SIGMA), _t(SIGMA_NEXT)), x + (SIGMA_NEXT - SIGMA) * v)


@pytest.mark.parametrize("kind", ["flow", "dance", "cps", "cps_gaussian"])
def test_transition_rollout_then_replay_is_bitwise_and_rounded(kind):
    v, x, eps = _inputs(4)
    x = x.to(torch.bfloat16).float()
    mask = torch.tensor([True, False, True])
    kw = dict(sde_mask=mask, noise_level=A, sigma_cap=_t(0.9), trajectory_dtype=torch.bfloat16)
    out = transition(kind, v, x, _t(SIGMA), _t(SIGMA_NEXT), noise=eps, **kw)
    assert torch.equal(out.prev_sample, out.prev_sample.to(torch.bfloat16).float())
    assert out.log_prob[1] == 0 and bool((out.log_prob[[0, 2]] != 0).all())
    torch.testing.assert_close(out.prev_sample[1], ode_mean(v, x, _t(SIGMA), _t(SIGMA_NEXT))[1].bfloat16().float())
    stored = out.prev_sample.to(torch.bfloat16)
    replay = transition(kind, v, x, _t(SIGMA), _t(SIGMA_NEXT), prev_sample=stored, **kw)
    assert torch.equal(replay.log_prob, out.log_prob)


def test_transition_needs_exactly_one_of_noise_or_prev():
    v, x, _ = _inputs(5)
    with pytest.raises(InvariantError):
        transition("flow", v, x, _t(SIGMA), _t(SIGMA_NEXT), sde_mask=torch.ones(3, dtype=torch.bool),
                   noise_level=A, sigma_cap=_t(0.9), trajectory_dtype=torch.float32)


@pytest.mark.parametrize("kind", ["flow", "dance", "cps", "cps_gaussian", "ode"])
def test_schedule_coefficients_equal_per_step_bitwise(kind):
    from unirl_core.sde import flow_sigmas, kernel_coefficients, schedule_coefficients, sigmas_tensor

    sig = sigmas_tensor(flow_sigmas(num_steps=10))
    table = schedule_coefficients(kind, sig, noise_level=A)
    for k in range(10):
        one = kernel_coefficients(kind, sig[k], sig[k + 1], noise_level=A, sigma_cap=sig[1])
        for col, val in zip(table, one):
            assert torch.equal(torch.as_tensor(col[k]), torch.as_tensor(val)), (kind, k)
