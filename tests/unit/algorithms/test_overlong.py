"""DAPO overlong shaping (arXiv 2503.14476, eq. 13) and truncated-completion masking.

Soft overlong punishment, L_max = max_new_tokens, L_cache = overlong_buffer_len:

    R_length(y) = 0                                   |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                = -1                                  L_max < |y|

times ``overlong_penalty_factor``, added to the total reward. Masking: a completion with
finish_reason 'length' contributes no token to the loss (TRL ``mask_truncated_completions``).
"""

import pytest
import torch

from unirl_core.algorithms.grpo import GRPO, GRPOConfig, truncated_completions
from unirl_core.algorithms.overlong import OVERLONG_COMPONENT, apply_overlong_penalty, overlong_penalty
from unirl_core.errors import ConfigError
from unirl_core.models.lm import build_tiny_lm
from unirl_core.types import ARSamplingParams, Part, Sample, SampleBatch, TokenSegment

torch.set_num_threads(1)


def test_golden_penalty_values():
    # L_max = 20, L_cache = 4: free up to 16 tokens, then -1/4 per token, -1 at and past the limit
    got = overlong_penalty(torch.tensor([0, 10, 16, 17, 18, 20, 25]), max_tokens=20, buffer_len=4)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    half = overlong_penalty(torch.tensor([18]), max_tokens=20, buffer_len=4, penalty_factor=0.5)
    assert half.tolist() == [-0.25]


def test_buffer_longer_than_the_budget_is_refused():
    with pytest.raises(ConfigError, match=r"overlong_buffer_len=30: expected an integer in \[1, max_new_tokens=20\]"):
        overlong_penalty(torch.tensor([3]), max_tokens=20, buffer_len=30)


def _part(i: int, n_tokens: int, finish: str, reward: float | None = 1.0, valid: bool = True) -> Sample:
    seg = TokenSegment(prompt_ids=torch.tensor([1, 2]), response_ids=torch.arange(3, 3 + n_tokens),
                       log_probs=torch.zeros(n_tokens), response_mask=torch.ones(n_tokens, dtype=torch.bool),
                       finish_reason=finish)
    p = Part(kind="ar", sample_id=f"g/{i}", group_id="g", prompt="q", segment=seg, reward=reward, valid=valid,
             sampling=ARSamplingParams(max_new_tokens=8))
    return Sample(sample_id=f"g/{i}", group_id="g", parts=[p])


def test_apply_adds_the_penalty_to_valid_totals_and_records_the_component():
    batch = SampleBatch(samples=[_part(0, 3, "stop"), _part(1, 7, "stop"), _part(2, 8, "length"),
                                 _part(3, 8, "length", reward=None, valid=False)])
    m = apply_overlong_penalty(batch, max_tokens=8, buffer_len=2, penalty_factor=1.0)
    parts = batch.generated
    assert [p.reward for p in parts] == [1.0, 0.5, 0.0, None]
    assert parts[1].rewards[OVERLONG_COMPONENT] == -0.5 and OVERLONG_COMPONENT not in parts[3].rewards
    assert m == {"reward/overlong_penalty_mean": pytest.approx(-0.5), "reward/overlong_frac": pytest.approx(2 / 3)}


def test_truncated_completions_are_masked_out_of_the_loss():
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    from tests.unit.algorithms.test_grpo_algorithm import _rollout

    batch = _rollout(bundle, fbs=12, max_new_tokens=3)
    for s in batch.samples[::3]:  # the random tiny model hardly samples EOS: call every third one finished
        s.generated.segment.finish_reason = "stop"
    trunc = truncated_completions(batch)
    assert trunc.tolist() == [i % 3 != 0 for i in range(12)]
    masked = GRPO(GRPOConfig(loss_agg="dapo", mask_truncated_completions=True))
    plain = GRPO(GRPOConfig(loss_agg="dapo"))
    out = masked.loss(bundle, batch, old_log_probs=None)
    assert out.metrics["truncated_frac"] == pytest.approx(float(trunc.float().mean()))
    # the same loss as training on the completed samples only (token mean over their tokens)
    finished = batch.select([i for i, t in enumerate(trunc.tolist()) if not t])
    want = plain.loss(bundle, finished, old_log_probs=None).loss
    torch.testing.assert_close(out.loss, want)
    # and no gradient reaches the parameters through the truncated samples alone
    only_trunc = batch.select([i for i, t in enumerate(trunc.tolist()) if t])
    bundle.module.zero_grad()
    masked.loss(bundle, only_trunc, old_log_probs=None).loss.backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in bundle.module.parameters())
