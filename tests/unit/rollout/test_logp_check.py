"""Log-prob agreement: golden mean/max, masking, non-finite values, fail-closed thresholds, replay."""

import math

import pytest
import torch

from unirl_core.errors import ConfigError, InvariantError, NumericsError
from unirl_core.models.lm import build_tiny_lm
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.rollout.logp_check import (
    LogpAgreement,
    LogpCheckConfig,
    check_logp_agreement,
    logp_agreement,
    replay_agreement,
    summarize,
)
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


def test_golden_mean_and_max_over_mask():
    engine = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 9.0]])
    replay = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -0.75, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])  # the 9.0 is padding
    a = logp_agreement(engine, replay, mask)
    # |diffs| on the mask: 0.5, 0, 1, 0, 0.5 -> mean 2/5, max 1
    assert a.num_tokens == 5 and a.mean_abs_diff == pytest.approx(0.4) and a.max_abs_diff == 1.0
    assert a.metrics() == {"logp_absdiff_mean": pytest.approx(0.4), "logp_absdiff_max": 1.0,
                           "logp_absdiff_tokens": 5.0}


def test_non_finite_counts_as_infinite_and_fails():
    engine = torch.tensor([[-1.0, float("-inf")]])
    a = logp_agreement(engine, torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool))
    assert math.isinf(a.max_abs_diff)
    with pytest.raises(NumericsError, match="logp_absdiff_max"):
        check_logp_agreement(a, LogpCheckConfig(max_abs_diff=10.0, mean_abs_diff=None))


def test_empty_mask_and_shape_errors():
    z = torch.zeros(2, 3)
    assert logp_agreement(z, z, torch.zeros(2, 3, dtype=torch.bool)).num_tokens == 0
    with pytest.raises(InvariantError, match="logp shapes"):
        logp_agreement(z, torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(InvariantError, match="mask.dtype"):
        logp_agreement(z, z, torch.ones(2, 3))


def test_thresholds_fail_closed_and_none_disables():
    a = LogpAgreement(mean_abs_diff=0.05, max_abs_diff=0.6, num_tokens=10)
    check_logp_agreement(a, LogpCheckConfig(max_abs_diff=0.6, mean_abs_diff=0.05))  # bounds are inclusive
    with pytest.raises(NumericsError, match=r"step3\.logp_absdiff_max=0\.6"):
        check_logp_agreement(a, LogpCheckConfig(max_abs_diff=0.5, mean_abs_diff=None), where="step3")
    with pytest.raises(NumericsError, match="logp_absdiff_mean"):
        check_logp_agreement(a, LogpCheckConfig(max_abs_diff=None, mean_abs_diff=0.01))
    check_logp_agreement(a, LogpCheckConfig(max_abs_diff=None, mean_abs_diff=None))
    with pytest.raises(ConfigError):
        LogpCheckConfig(max_abs_diff=-1.0)


def test_summarize_is_token_weighted():
    s = summarize([LogpAgreement(mean_abs_diff=1.0, max_abs_diff=2.0, num_tokens=1),
                   LogpAgreement(mean_abs_diff=0.0, max_abs_diff=0.5, num_tokens=3)])
    assert s.mean_abs_diff == pytest.approx(0.25) and s.max_abs_diff == 2.0 and s.num_tokens == 4


def test_replay_agreement_is_zero_for_trainside_and_catches_tampering():
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=f"{i} + {i} =") for i in range(2)]
    batch = SampleBatch.from_prompts(recs, samples_per_prompt=2, kind="ar",
                                     sampling=ARSamplingParams(max_new_tokens=6, seed=3, temperature=0.7))
    out = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=4)).generate(batch)
    a = replay_agreement(bundle, out, micro_batch_size=4)
    assert a.max_abs_diff == 0.0 and a.num_tokens == sum(p.segment.num_response_tokens for p in out.generated)
    out.generated[1].segment.log_probs[0] += 0.3
    b = replay_agreement(bundle, out, micro_batch_size=4)
    assert b.max_abs_diff == pytest.approx(0.3, abs=1e-6)
    with pytest.raises(NumericsError):
        check_logp_agreement(b, LogpCheckConfig(max_abs_diff=0.1))
