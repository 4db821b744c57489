"""CISPO (MiniMax-M1, arXiv 2506.13585, eq. for J_CISPO) against a hand transcription.

    r_t  = pi_theta(o_t) / pi_old(o_t) = exp(logp_t - logp_old_t)
    w_t  = sg(clip(r_t, 1 - eps_low, 1 + eps_high))            (eps_low None: no lower bound)
    J    = 1 / sum_i |o_i| * sum_i sum_t w_t * A_i * logp_t
    loss = -J,   d loss / d logp_t = -w_t * A_i / sum_i |o_i|
"""

import math

import pytest
import torch

from unirl_core.algorithms.cispo import CISPO, CISPOConfig, cispo_token_loss
from unirl_core.algorithms.grpo import GRPOConfig, grpo_token_loss
from unirl_core.errors import ConfigError
from unirl_core.models.lm import build_tiny_lm

torch.set_num_threads(1)

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]])
OLD = torch.tensor([[-1.5, -2.0, -0.2], [-0.7, -0.9, -3.0]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[True, True, True], [True, True, False]])
E = math.exp(-0.3)  # the ratio of the tokens whose logp fell by 0.3


def test_golden_loss_and_gradient_token_mean():
    logp = LOGP.clone().requires_grad_(True)
    loss, stats = cispo_token_loss(logp, OLD, ADV, MASK, CISPOConfig(epsilon_high=0.28))
    # ratios [[e^0.5, 1, e^-0.3], [1, e^-0.3, -]]; e^0.5 = 1.65 is truncated to 1.28, no lower bound
    w = [[1.28, 1.0, E], [1.0, E]]
    want = (-(w[0][0] * 1.0 * -1.0) - (w[0][1] * 1.0 * -2.0) - (w[0][2] * 1.0 * -0.5)
            - (w[1][0] * -2.0 * -0.7) - (w[1][1] * -2.0 * -1.2)) / 5
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.28, -1.0, -E], [2.0, 2.0 * E, 0.0]]) / 5)
    assert stats["clipped"].tolist() == [[True, False, False], [False, False, False]]


def test_lower_bound_and_sequence_mean_aggregation():
    logp = LOGP.clone().requires_grad_(True)
    loss, stats = cispo_token_loss(logp, OLD, ADV, MASK, CISPOConfig(epsilon_high=1.0, epsilon_low=0.2,
                                                                      loss_agg="grpo"))
    # e^0.5 < 2 stays, e^-0.3 = 0.74 is raised to 0.8; loss_agg grpo: mean over sequences of token means
    row0 = (-(math.exp(0.5) * -1.0) - (1.0 * -2.0) - (0.8 * -0.5)) / 3
    row1 = (-(1.0 * -2.0 * -0.7) - (0.8 * -2.0 * -1.2)) / 2
    assert float(loss.detach()) == pytest.approx((row0 + row1) / 2, rel=1e-6)
    assert stats["clipped"].tolist() == [[False, False, True], [False, True, False]]


def test_truncated_tokens_keep_their_gradient_where_ppo_clipping_drops_it():
    # Token (0, 0) has ratio e^0.5 > 1 + eps with A > 0: GRPO's clipped objective gives it zero gradient,
    # CISPO keeps -w A / N with w truncated to 1 + eps_high.
    g_logp = LOGP.clone().requires_grad_(True)
    grpo_token_loss(g_logp, OLD, ADV, MASK, GRPOConfig(loss_agg="dapo", epsilon=0.2, epsilon_high=0.28))[0].backward()
    c_logp = LOGP.clone().requires_grad_(True)
    cispo_token_loss(c_logp, OLD, ADV, MASK, CISPOConfig(epsilon_high=0.28))[0].backward()
    assert float(g_logp.grad[0, 0]) == 0.0
    assert float(c_logp.grad[0, 0]) == pytest.approx(-1.28 / 5)


def test_on_policy_gradient_equals_grpo_token_mean():
    # At ratio 1 (the first update) the truncation is inactive: same gradient as GRPO with token mean.
    g_logp = OLD.clone().requires_grad_(True)
    grpo_token_loss(g_logp, OLD, ADV, MASK, GRPOConfig(loss_agg="dapo"))[0].backward()
    c_logp = OLD.clone().requires_grad_(True)
    cispo_token_loss(c_logp, OLD, ADV, MASK, CISPOConfig())[0].backward()
    torch.testing.assert_close(c_logp.grad, g_logp.grad)


@pytest.mark.parametrize("kw", [{"epsilon_high": 0.0}, {"epsilon_high": float("inf")}, {"epsilon_low": 1.5},
                                {"loss_agg": "token"}, {"beta": -0.1}])
def test_config_validation(kw):
    with pytest.raises(ConfigError):
        CISPOConfig(**kw)


def test_first_update_ratio_is_exactly_one_on_the_tiny_lm():
    from tests.unit.algorithms.test_grpo_algorithm import _loss_metrics, _rollout

    bundle = build_tiny_lm(seed=0, keep_reference=False)
    batch = _rollout(bundle, fbs=4)
    for m in _loss_metrics(CISPO(CISPOConfig(max_logp_absdiff=0.0)), bundle, batch, 4):
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["clip_frac"] == 0.0
        assert m["logp_absdiff_max"] == 0.0
