"""KL estimators against hand-computed values."""

import math

import pytest
import torch

from unirl_core.algorithms.kl import kl_penalty
from unirl_core.errors import ConfigError, InvariantError

LOGP = torch.tensor([-1.0, -2.0, -0.7])
REF = torch.tensor([-1.5, -1.5, -0.7])  # d = logp - ref = [0.5, -0.5, 0]


def test_k1_is_the_log_ratio():
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k1"), torch.tensor([0.5, -0.5, 0.0]))


def test_k2_is_half_squared_log_ratio():
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k2"), torch.tensor([0.125, 0.125, 0.0]))


def test_k3_golden_values():
    want = torch.tensor([math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5, 0.0])
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k3"), want)


def test_k3_gradient_flows_through_logp_only():
    logp = LOGP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    kl_penalty(logp, ref, "k3").sum().backward()
    # d/dlogp [exp(-d) - 1 + d] = 1 - exp(-d)
    torch.testing.assert_close(logp.grad, torch.tensor([1 - math.exp(-0.5), 1 - math.exp(0.5), 0.0]))


def test_k3_matches_exact_kl_in_expectation():
    # Two-token distributions: sampling from p, E[k3] = KL(p || q).
    p = torch.tensor([0.7, 0.3])
    q = torch.tensor([0.4, 0.6])
    k3 = kl_penalty(p.log(), q.log(), "k3")
    torch.testing.assert_close((p * k3).sum(), (p * (p / q).log()).sum())


def test_bad_inputs():
    with pytest.raises(ConfigError):
        kl_penalty(LOGP, REF, "k4")
    with pytest.raises(InvariantError):
        kl_penalty(LOGP, REF[:2], "k1")
