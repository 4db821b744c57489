"""GRPO-family loss math against hand-computed values (pure functions, no model)."""

import math

import pytest
import torch

from unirl_core.algorithms.grpo import GRPOConfig, aggregate, grpo_token_loss, log_ratios
from unirl_core.errors import ConfigError, InvariantError

# B = 2, R = 3; the last token of row 1 is padding and carries garbage that must not leak.
LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.3, 55.0]])
OLD = torch.tensor([[-1.1, -2.0, -0.2], [-0.3, -1.0, -70.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([1.0, -2.0])

# Token ratios: row 0 = e^0.1, 1, e^-0.3 (A = +1); row 1 = 1, e^-0.3 (A = -2).
# pg = -min(r A, clip(r, 0.8, 1.2) A):
#   row 0: -e^0.1, -1, -e^-0.3 (r < 0.8 but A > 0: the unclipped term is the min)
#   row 1: 2, 1.6 (r < 0.8 and A < 0: clipped to 0.8 -> -min(-2 e^-0.3, -1.6) = 1.6)
ROW0 = [-math.exp(0.1), -1.0, -math.exp(-0.3)]
ROW1 = [2.0, 1.6]


def _loss(cfg, **kw):
    return grpo_token_loss(LOGP, OLD, ADV, MASK, cfg, **kw)


def test_grpo_aggregation_is_mean_of_sequence_means():
    loss, stats = _loss(GRPOConfig(loss_agg="grpo"))
    assert math.isclose(float(loss), (sum(ROW0) / 3 + sum(ROW1) / 2) / 2, rel_tol=1e-6)
    # Only row 1 token 1 is clipped (ratio below 1 - eps with a negative advantage).
    assert stats["clipped"].tolist() == [[False, False, False], [False, True, False]]


def test_dapo_aggregation_is_token_mean():
    loss, _ = _loss(GRPOConfig(loss_agg="dapo"))
    assert math.isclose(float(loss), (sum(ROW0) + sum(ROW1)) / 5, rel_tol=1e-6)


def test_dr_grpo_aggregation_uses_constant_normaliser():
    loss, _ = _loss(GRPOConfig(loss_agg="dr_grpo", max_response_tokens=4))
    assert math.isclose(float(loss), (sum(ROW0) + sum(ROW1)) / (2 * 4), rel_tol=1e-6)


def test_asymmetric_clip_higher():
    logp = torch.tensor([[0.25, 0.0]])
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0])
    sym, st = grpo_token_loss(logp, old, adv, mask, GRPOConfig(loss_agg="dapo", epsilon=0.2))
    high, st_high = grpo_token_loss(logp, old, adv, mask, GRPOConfig(loss_agg="dapo", epsilon=0.2, epsilon_high=0.28))
    # e^0.25 = 1.284: clipped to 1.2 with eps 0.2, to 1.28 with eps_high 0.28.
    assert math.isclose(float(sym), -(1.2 + 1.0) / 2, rel_tol=1e-6)
    assert math.isclose(float(high), -(1.28 + 1.0) / 2, rel_tol=1e-6)
    assert st["clipped"].tolist() == [[True, False]] and st_high["clipped"].tolist() == [[True, False]]


def test_sequence_level_ratio_is_length_normalised():
    loss, stats = _loss(GRPOConfig(loss_agg="grpo", ratio_level="sequence"))
    s0, s1 = math.exp((0.1 + 0.0 - 0.3) / 3), math.exp(-0.3 / 2)
    assert math.isclose(float(loss), (-s0 + 2 * s1) / 2, rel_tol=1e-6)
    torch.testing.assert_close(stats["ratio"][0], torch.full((3,), s0))
    torch.testing.assert_close(stats["ratio"][1, :2], torch.full((2,), s1))


def test_sequence_level_gradient_is_shared_by_tokens():
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = grpo_token_loss(logp, OLD, ADV, MASK, GRPOConfig(loss_agg="grpo", ratio_level="sequence"))
    loss.backward()
    s0 = math.exp(-0.2 / 3)
    # d/dlogp_t of -(1/2) * s0 (row mean of identical values) = -(1/2) * s0 / 3 for every real token.
    torch.testing.assert_close(logp.grad[0], torch.full((3,), -0.5 * s0 / 3))
    assert logp.grad[1, 2] == 0


def test_kl_term_adds_beta_times_k3():
    ref = LOGP - 0.5  # d = 0.5 on every token
    loss, stats = _loss(GRPOConfig(loss_agg="grpo", beta=0.5), ref_logp=ref)
    k3 = math.exp(-0.5) - 1 + 0.5
    assert math.isclose(float(loss), (sum(ROW0) / 3 + sum(ROW1) / 2) / 2 + 0.5 * k3, rel_tol=1e-6)
    torch.testing.assert_close(stats["kl"][MASK], torch.full((5,), k3))
    with pytest.raises(InvariantError, match="ref_logp"):
        _loss(GRPOConfig(beta=0.5))


def test_truncated_importance_sampling_weights():
    logp = torch.tensor([[-1.0, -1.0]])
    old = logp.clone()
    rollout = torch.tensor([[-1.1, -3.0]])  # weights e^0.1 and min(e^2, 2) = 2
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = grpo_token_loss(logp, old, torch.tensor([1.0]), mask, GRPOConfig(loss_agg="dapo", tis_cap=2.0),
                                  rollout_logp=rollout)
    assert math.isclose(float(loss), -(math.exp(0.1) + 2.0) / 2, rel_tol=1e-6)
    torch.testing.assert_close(stats["tis"], torch.tensor([[math.exp(0.1), 2.0]]))


def test_padding_never_leaks_into_loss_or_gradient():
    logp = LOGP.clone().requires_grad_(True)
    for agg in ("grpo", "dapo", "dr_grpo"):
        loss, _ = grpo_token_loss(logp, OLD, ADV, MASK, GRPOConfig(loss_agg=agg, max_response_tokens=3, beta=0.1),
                                  ref_logp=LOGP - 1.0)
        assert math.isfinite(float(loss.detach()))
        logp.grad = None
        loss.backward()
        assert logp.grad[1, 2] == 0


def test_first_update_gradient_is_advantage_weighted_score():
    # At ratio 1 (logp == old) the GRPO gradient w.r.t. logp_t is -A / (n_tokens * B).
    logp = OLD.clone().requires_grad_(True)
    loss, stats = grpo_token_loss(logp, OLD, ADV, MASK, GRPOConfig(loss_agg="grpo"))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [1 / 2, 1 / 2, 0.0]]))
    assert bool((stats["ratio"] == 1.0).all())


def test_log_ratios_and_aggregate_helpers():
    lr = log_ratios(LOGP, OLD, MASK.float(), "token")
    torch.testing.assert_close(lr, torch.tensor([[0.1, 0.0, -0.3], [0.0, -0.3, 0.0]]))
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert float(aggregate(x, MASK, "grpo", None)) == pytest.approx((2.0 + 4.5) / 2)
    assert float(aggregate(x, MASK, "dapo", None)) == pytest.approx(15.0 / 5)
    assert float(aggregate(x, MASK, "dr_grpo", 10)) == pytest.approx(15.0 / 20)


@pytest.mark.parametrize("kw", [{"loss_agg": "ppo"}, {"epsilon": 0.0}, {"beta": -1.0}, {"kl_estimator": "k5"},
                                {"ratio_level": "seq"}, {"tis_cap": 0.5}, {"loss_agg": "dr_grpo"},
                                {"max_logp_absdiff": -1.0}])
def test_config_validation(kw):
    with pytest.raises(ConfigError):
        GRPOConfig(**kw)
