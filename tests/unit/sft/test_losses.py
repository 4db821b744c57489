"""SFT loss formulas against hand-computed values, and determinism of the per-sample draws."""

from __future__ import annotations

import math

import pytest
import torch

from unirl_core.errors import InvariantError
from unirl_core.sft.config import FlowMatchingConfig
from unirl_core.sft.losses import (
    completion_nll,
    draw_noise,
    flow_matching_loss,
    flow_matching_pair,
    sample_sigmas,
)

torch.set_num_threads(1)


def test_flow_matching_pair_by_hand():
    x0 = torch.tensor([[[[1.0, -2.0]]], [[[0.5, 0.0]]]])  # [2, 1, 1, 2]
    eps = torch.tensor([[[[3.0, 1.0]]], [[[-1.0, 2.0]]]])
    sigma = torch.tensor([0.25, 0.5])
    x_s, target = flow_matching_pair(x0, eps, sigma)
    # sample 0: 0.75*1 + 0.25*3 = 1.5 ; 0.75*-2 + 0.25*1 = -1.25 ; target 3-1 = 2, 1+2 = 3
    # sample 1: 0.5*0.5 + 0.5*-1 = -0.25 ; 0 + 0.5*2 = 1.0 ; target -1.5, 2
    assert x_s.flatten().tolist() == [1.5, -1.25, -0.25, 1.0]
    assert target.flatten().tolist() == [2.0, 3.0, -1.5, 2.0]


def test_flow_matching_endpoints():
    x0, eps = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    at0, _ = flow_matching_pair(x0, eps, torch.zeros(3))
    at1, _ = flow_matching_pair(x0, eps, torch.ones(3))
    assert torch.equal(at0, x0) and torch.equal(at1, eps)


def test_flow_matching_loss_by_hand():
    v = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    t = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    # squared errors 1, 4, 1, 4 -> mean 2.5
    assert flow_matching_loss(v, t).item() == 2.5


def test_sigma_sampling_by_hand():
    u = torch.tensor([0.0, 1.0, -2.0])
    ln = sample_sigmas(u, FlowMatchingConfig(sigma_sampling="logit_normal", logit_mean=0.5, logit_std=2.0))
    want = [1 / (1 + math.exp(-(0.5 + 2.0 * x))) for x in (0.0, 1.0, -2.0)]
    assert ln.tolist() == pytest.approx(want, abs=1e-7)
    uni = sample_sigmas(torch.tensor([0.1, 0.9]), FlowMatchingConfig(sigma_sampling="uniform"))
    assert uni.tolist() == pytest.approx([0.1, 0.9])


def test_completion_nll_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -7.0, -7.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert completion_nll(logp, mask).item() == pytest.approx((1.0 + 2.0 + 0.5) / 3)
    with pytest.raises(InvariantError, match="completion tokens"):
        completion_nll(logp, torch.zeros_like(mask))


def test_draws_are_per_sample_and_order_independent():
    cfg = FlowMatchingConfig(caption_dropout=0.5)
    e1, s1, k1 = draw_noise(["a", "b", "c"], 7, (2, 2, 2), cfg)
    e2, s2, k2 = draw_noise(["c", "a"], 7, (2, 2, 2), cfg)
    assert torch.equal(e1[2], e2[0]) and torch.equal(e1[0], e2[1])
    assert s1[2] == s2[0] and k1[0] == k2[1]
    assert ((s1 > 0) & (s1 < 1)).all()
    e3, _, _ = draw_noise(["a"], 8, (2, 2, 2), cfg)
    assert not torch.equal(e1[0], e3[0])  # another seed, other noise
    _, _, keep = draw_noise([f"s{i}" for i in range(400)], 0, (1,), cfg)
    assert 0.4 < keep.float().mean().item() < 0.6  # dropout close to the configured 0.5
