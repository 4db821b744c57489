"""Off-policy correction: golden values of TIS / MIS (token and sequence level), AReaL's decoupled objective,
staleness, and the fail-closed check that exempts only stale rows (LM and Flow-GRPO)."""

from __future__ import annotations

import math

import pytest
import torch

from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl_core.algorithms.grpo import GRPO, GRPOConfig, grpo_token_loss
from unirl_core.algorithms.off_policy import (
    TRAINER_VERSION_KEY,
    behaviour_weights,
    fresh_rows,
    sample_staleness,
    staleness_metrics,
)
from unirl_core.errors import ConfigError, NumericsError

torch.set_num_threads(1)

PROX = torch.tensor([[-1.0, -1.0, -2.0], [-0.5, -0.5, 0.0]])
BEHAV = torch.tensor([[-1.5, -0.2, -2.0], [-0.5, -3.0, 0.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_token_tis_golden():
    """w_t = min(exp(logp_prox_t - logp_behav_t), C); 1 off the mask."""
    w, masked, trunc = behaviour_weights(PROX, BEHAV, MASK, level="token", tis_cap=2.0, mis_bounds=None)
    want = torch.tensor([[min(math.exp(0.5), 2.0), math.exp(-0.8), 1.0], [1.0, min(math.exp(2.5), 2.0), 1.0]])
    torch.testing.assert_close(w, want)
    assert trunc.tolist() == [[False, False, False], [False, True, False]] and not masked.any()


def test_sequence_tis_golden():
    """w = min(exp(sum_t (logp_prox_t - logp_behav_t)), C) shared by the sequence's tokens."""
    w, _, trunc = behaviour_weights(PROX, BEHAV, MASK, level="sequence", tis_cap=3.0, mis_bounds=None)
    s0, s1 = math.exp(0.5 - 0.8 + 0.0), min(math.exp(0.0 + 2.5), 3.0)
    torch.testing.assert_close(w, torch.tensor([[s0, s0, s0], [s1, s1, 1.0]]))
    assert trunc.tolist() == [[False] * 3, [True, True, False]]


def test_token_mis_golden_icepop():
    """IcePop: M(k) = k if low <= k <= high else 0, k = pi_prox / pi_behav per token."""
    w, masked, _ = behaviour_weights(PROX, BEHAV, MASK, level="token", tis_cap=None, mis_bounds=(0.5, 1.5))
    # k = e^0.5 = 1.65 (out), e^-0.8 = 0.45 (out), 1, 1, e^2.5 (out)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 1.0]]))
    assert masked.tolist() == [[True, True, False], [False, True, False]]
    w2, _, _ = behaviour_weights(PROX, BEHAV, MASK, level="token", tis_cap=None, mis_bounds=(0.4, 2.0))
    torch.testing.assert_close(w2, torch.tensor([[math.exp(0.5), math.exp(-0.8), 1.0], [1.0, 0.0, 1.0]]))


def test_sequence_mis_masks_whole_sequences_and_survives_overflow():
    behav = BEHAV.clone()
    behav[1, 1] = -500.0  # exp(sum) overflows to inf: the sequence is masked, never NaN
    w, masked, _ = behaviour_weights(PROX, behav, MASK, level="sequence", tis_cap=None, mis_bounds=(0.5, 2.0))
    s0 = math.exp(-0.3)
    torch.testing.assert_close(w, torch.tensor([[s0, s0, s0], [0.0, 0.0, 1.0]]))
    assert masked.tolist() == [[False] * 3, [True, True, False]] and torch.isfinite(w).all()


def test_areal_decoupled_objective_golden():
    """AReaL eq. 5 (token mean, ``loss_agg: dapo``):
    L = -(1/N) sum_t min(pi_prox/pi_behav, C) * min(u_t A, clip(u_t, 1 - eps, 1 + eps) A), u_t = pi_theta/pi_prox.
    Hand values with A = 1, eps = 0.2, C = 2: tokens (theta, prox, behav) =
      (-0.9, -1.0, -1.5): u = e^0.1 = 1.105 (inside), w = min(e^0.5, 2) = 1.6487 -> 1.105 * 1.6487
      (-0.5, -1.0, -0.2): u = e^0.5 = 1.6487 -> clipped 1.2, w = e^-0.8 = 0.4493 -> 1.2 * 0.4493
      (-2.0, -2.0, -4.0): u = 1, w = min(e^2, 2) = 2 -> 2
    and its gradient d L / d logp_theta_t = -w_t u_t A / N where unclipped, 0 where clipped."""
    theta = torch.tensor([[-0.9, -0.5, -2.0]], requires_grad=True)
    prox = torch.tensor([[-1.0, -1.0, -2.0]])
    behav = torch.tensor([[-1.5, -0.2, -4.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    cfg = GRPOConfig(loss_agg="dapo", epsilon=0.2, tis_cap=2.0)
    loss, stats = grpo_token_loss(theta, prox, torch.tensor([1.0]), mask, cfg, rollout_logp=behav)
    terms = [math.exp(0.1) * min(math.exp(0.5), 2.0), 1.2 * math.exp(-0.8), 1.0 * 2.0]
    assert float(loss.detach()) == pytest.approx(-sum(terms) / 3, rel=1e-6)
    loss.backward()
    want = torch.tensor([[-min(math.exp(0.5), 2.0) * math.exp(0.1) / 3, 0.0, -2.0 / 3]])
    torch.testing.assert_close(theta.grad, want)
    assert stats["is_truncated"].tolist() == [[False, False, True]]


def test_grpo_mis_sequence_level_in_the_loss():
    """MIS at sequence level drops the whole sequence from the loss sum; the grpo normaliser is unchanged."""
    logp = PROX.clone()
    cfg = GRPOConfig(loss_agg="grpo", mis_bounds=(0.5, 2.0), is_level="sequence")
    loss, stats = grpo_token_loss(logp, PROX, torch.tensor([1.0, 1.0]), MASK, cfg, rollout_logp=BEHAV)
    # seq 0: k = e^-0.3 (kept), ratio 1 -> per token -k; seq 1: k = e^2.5 (masked) -> 0
    assert float(loss) == pytest.approx((-math.exp(-0.3) + 0.0) / 2, rel=1e-6)
    assert stats["is_masked"].tolist() == [[False] * 3, [True, True, False]]


def test_no_correction_is_bitwise_the_plain_loss():
    logp = PROX + 0.05
    a, _ = grpo_token_loss(logp, PROX, torch.tensor([1.0, -1.0]), MASK, GRPOConfig(), rollout_logp=BEHAV)
    b, _ = grpo_token_loss(logp, PROX, torch.tensor([1.0, -1.0]), MASK, GRPOConfig(), rollout_logp=None)
    assert float(a) == float(b)


@pytest.mark.parametrize("kw,field", [({"mis_bounds": (1.2, 2.0)}, "mis_bounds"), ({"mis_bounds": (0.5,)}, "mis_bounds"),
                                      ({"is_level": "seq"}, "is_level"), ({"tis_cap": 0.9}, "tis_cap")])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=f"grpo.{field}"):
        GRPOConfig(**kw)
    with pytest.raises(ConfigError, match="flow_grpo.tis_cap"):
        FlowGRPOConfig(tis_cap=0.5)


def _lm_batch():
    from unirl_core.data import toy_arithmetic_prompts
    from unirl_core.models.lm import build_tiny_lm
    from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
    from unirl_core.types import ARSamplingParams, SampleBatch

    bundle = build_tiny_lm(seed=0, keep_reference=False)
    eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=4), policy_version=3)
    batch = eng.generate(SampleBatch.from_prompts(toy_arithmetic_prompts()[:1], samples_per_prompt=4, kind="ar",
                                                  sampling=ARSamplingParams(max_new_tokens=8, seed=1)))
    for i, s in enumerate(batch.samples):
        s.generated.advantage = float(i % 2) - 0.5
    return bundle, batch


def test_staleness_from_the_trainer_version():
    _, batch = _lm_batch()
    assert sample_staleness(batch) is None and fresh_rows(batch).all()
    batch.metadata[TRAINER_VERSION_KEY] = "5"
    assert sample_staleness(batch).tolist() == [2, 2, 2, 2]
    assert staleness_metrics(batch) == {"staleness_mean": 2.0, "staleness_max": 2.0}
    assert not fresh_rows(batch).any()


def test_lm_fail_closed_check_exempts_only_stale_rows():
    """After an update the replay differs from the stored log-probs: a fresh row (sampled by the trainer's
    weights) still fails closed, a stale one is corrected instead and reports its drift and weights."""
    bundle, batch = _lm_batch()
    with torch.no_grad():
        for p in bundle.module.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the trainer moved on
    alg = GRPO(GRPOConfig(max_logp_absdiff=1e-6, tis_cap=2.0, mis_bounds=(0.8, 1.25)))
    batch.metadata[TRAINER_VERSION_KEY] = "3"  # fresh rows
    with pytest.raises(NumericsError, match="logp_absdiff_max"):
        alg.old_log_probs(bundle, batch)
    batch.metadata[TRAINER_VERSION_KEY] = "4"  # the same rows, one version stale
    old = alg.old_log_probs(bundle, batch)
    m = alg.loss(bundle, batch, old_log_probs=old).metrics
    assert m["staleness_mean"] == 1.0 and m["logp_absdiff_max"] > 1e-3
    assert 0.0 < m["is_masked_frac"] < 1.0 and "is_weight_mean" in m and "is_truncated_frac" in m


def test_flow_grpo_behaviour_weight_golden_and_stale_rows():
    """Flow-GRPO with tis_cap: per trained step, loss_entry = max(-A r, -A clip(r, 1 - eps, 1 + eps)) *
    min(exp(logp_old - logp_behav), C), r = exp(logp_theta - logp_old), averaged over the trained entries.
    Here the weights are unchanged (logp_theta = logp_behav, the stored log-probs) and pi_old = stored + delta,
    so r = exp(-delta) and w = min(exp(delta), C)."""
    from tests.unit.algorithms.test_flow_grpo import FBS, _rollout

    bundle, batch = _rollout(n_prompts=1, per=4, steps=4)
    mb = batch.split(FBS)[0]
    stored = torch.stack([p.segment.log_probs for p in mb.generated])
    mask = torch.stack([p.segment.sde_mask for p in mb.generated])
    delta = torch.linspace(-0.3, 0.9, stored.numel()).reshape(stored.shape)
    old = stored + delta
    algo = FlowGRPO(FlowGRPOConfig(replay_batch_size=FBS, clip_range=0.2, tis_cap=2.0, logp_tolerance=1e-3))
    with pytest.raises(NumericsError):  # unstamped: every row is held to the tolerance
        algo.loss(bundle, mb, old_log_probs=old)
    mb.metadata[TRAINER_VERSION_KEY] = str(mb.generated[0].policy_version + 1)
    out = algo.loss(bundle, mb, old_log_probs=old)
    adv = torch.tensor([p.advantage for p in mb.generated]).clamp(-5, 5)[:, None]
    r = torch.exp(-delta)
    per = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)) * torch.exp(delta).clamp(max=2.0)
    want = float((per * mask).sum() / mask.sum())
    assert float(out.loss) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert out.metrics["staleness_max"] == 1.0 and 0 < out.metrics["is_truncated_frac"] < 1
