"""Partial rollouts: an interrupted completion continues under new weights; each token keeps the behaviour
log-prob of the policy that sampled it; old-policy tokens are masked or kept for correction."""

from __future__ import annotations

import pytest
import torch

from unirl_core.data import toy_arithmetic_prompts
from unirl_core.errors import ConfigError
from unirl_core.models.lm import build_layout, build_tiny_lm, replay_log_probs
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.rollout.partial import continue_generation
from unirl_core.types import ARSamplingParams, SampleBatch

torch.set_num_threads(1)
T, TOTAL = 3, 7


def _phase_a():
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=4), policy_version=5)
    sp = ARSamplingParams(max_new_tokens=T, seed=3, temperature=1.0)
    batch = eng.generate(SampleBatch.from_prompts(toy_arithmetic_prompts()[:2], samples_per_prompt=4, kind="ar",
                                                  sampling=sp))
    with torch.no_grad():  # the weight update that arrives mid-generation
        for p in bundle.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return bundle, eng, batch


def _replay(bundle, segs):
    layout = build_layout(segs, [1.0] * len(segs), pad_id=bundle.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad(), bundle.compute():
        logp, _ = replay_log_probs(bundle.module, layout, chunk_tokens=bundle.logprob_chunk_tokens)
    return [logp[j, :s.num_response_tokens] for j, s in enumerate(segs)]


@pytest.mark.parametrize("old_tokens", ["correct", "mask"])
def test_interrupted_completions_continue_under_the_new_weights(old_tokens):
    bundle, eng, a = _phase_a()
    out, metrics = continue_generation(eng, a, max_new_tokens=TOTAL, generator=torch.Generator().manual_seed(1),
                                       old_tokens=old_tokens)
    running = [i for i, p in enumerate(a.generated) if p.segment.finish_reason == "length"]
    assert running, "the tiny model stopped every completion early: no interruption to test"
    new_logp = _replay(bundle, [p.segment for p in out.generated])
    for i, (pa, po) in enumerate(zip(a.generated, out.generated)):
        sa, so = pa.segment, po.segment
        t = sa.num_response_tokens
        assert torch.equal(so.response_ids[:t], sa.response_ids) and torch.equal(so.log_probs[:t], sa.log_probs)
        assert po.policy_version == 5 and po.sampling.max_new_tokens == TOTAL
        if i in running:
            assert so.num_response_tokens > t
            # the continuation's behaviour log-probs are the new weights' (rescored over the whole sequence)
            torch.testing.assert_close(so.log_probs[t:], new_logp[i][t:], rtol=0, atol=1e-6)
            # ... and the old tokens' are not the new weights' (the update really changed the policy)
            assert (so.log_probs[:t] - new_logp[i][:t]).abs().max() > 1e-3
        else:
            assert torch.equal(so.response_ids, sa.response_ids)
        want = torch.ones(so.num_response_tokens, dtype=torch.bool)
        if old_tokens == "mask":
            want[:t] = False
        assert torch.equal(so.response_mask, want)
    assert metrics["rollout/partial_continued_frac"] == len(running) / len(a)
    assert 0 < metrics["rollout/partial_old_token_frac"] < 1


def test_masked_old_tokens_leave_the_loss():
    from unirl_core.algorithms.grpo import GRPO, GRPOConfig

    bundle, eng, a = _phase_a()
    out, _ = continue_generation(eng, a, max_new_tokens=TOTAL, generator=torch.Generator().manual_seed(1),
                                 old_tokens="mask")
    layout = GRPO(GRPOConfig()).layout(bundle, out)
    assert int(layout.loss_mask.sum()) == sum(int(p.segment.response_mask.sum()) for p in out.generated)


def test_bad_mode_names_the_field():
    _, eng, a = _phase_a()
    with pytest.raises(ConfigError, match="partial_rollout.old_tokens"):
        continue_generation(eng, a, max_new_tokens=TOTAL, generator=torch.Generator(), old_tokens="drop")
