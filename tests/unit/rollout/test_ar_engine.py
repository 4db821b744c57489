"""Trainside AR engine: segments, finish reasons, templates, seeds, sampling filters, batching."""

import pytest
import torch

from unirl_core.errors import ConfigError, EngineError
from unirl_core.models.lm import build_tiny_lm
from unirl_core.models.text import decode_completion
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine, sample_next
from unirl_core.rollout.base import RolloutEngine
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


@pytest.fixture(scope="module")
def bundle():
    return build_tiny_lm(seed=0, keep_reference=False)


def _batch(n_prompts=3, k=2, **sp):
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=f"{i} + {i} =", targets={"answer": str(2 * i)})
            for i in range(n_prompts)]
    return SampleBatch.from_prompts(recs, samples_per_prompt=k, kind="ar",
                                    sampling=ARSamplingParams(**{"max_new_tokens": 8, **sp}))


def test_generate_fills_every_part(bundle):
    eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=4), policy_version=7)
    assert isinstance(eng, RolloutEngine)
    req = _batch(seed=1)
    out = eng.generate(req)
    assert [s.sample_id for s in out] == [s.sample_id for s in req]
    assert all(s.generated.segment is None for s in req)  # the request batch is not mutated
    for s in out:
        g = s.generated
        seg = g.segment
        assert g.policy_version == 7 and g.targets == s.generated.targets
        assert 1 <= seg.num_response_tokens <= 8 and seg.response_mask.all()
        assert bool((seg.log_probs <= 0).all()) and torch.isfinite(seg.log_probs).all()
        assert seg.finish_reason in ("stop", "length")
        eos = set(bundle.eos_token_ids)
        ids = seg.response_ids.tolist()
        assert (seg.finish_reason == "stop") == (ids[-1] in eos)
        assert not any(t in eos for t in ids[:-1])
        # the whole completion decoded once; a character cut by max_new_tokens is dropped, not U+FFFD
        want = decode_completion(bundle.tokenizer, ids, skip_ids=eos)
        full = bundle.tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)
        assert g.text == want and full.startswith(want)


def test_prompt_uses_chat_template_when_available(bundle):
    tok = bundle.tokenizer
    with_t = TrainsideAREngine(bundle).encode_prompt("1 + 2 =")
    assert tok.decode(with_t) == "<|im_start|>user\n1 + 2 =<|im_end|>\n<|im_start|>assistant\n"
    plain = TrainsideAREngine(bundle, AREngineConfig(apply_chat_template=False)).encode_prompt("1 + 2 =")
    assert tok.decode(plain) == "1 + 2 ="
    sys_t = TrainsideAREngine(bundle, AREngineConfig(system_prompt="Be brief.")).encode_prompt("x")
    assert tok.decode(sys_t).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nx")


def test_seeded_sampling_is_reproducible_and_seed_sensitive(bundle):
    eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=8))
    a = eng.generate(_batch(seed=3))
    b = eng.generate(_batch(seed=3))
    c = eng.generate(_batch(seed=4))
    ids = lambda o: [s.generated.segment.response_ids.tolist() for s in o]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_length_finish_reason_and_max_tokens(bundle):
    # Forbid EOS by making it impossible to sample: top_k=1 picks the argmax, which is not EOS here.
    out = TrainsideAREngine(bundle).generate(_batch(max_new_tokens=5, top_k=1))
    for s in out:
        seg = s.generated.segment
        if seg.finish_reason == "length":
            assert seg.num_response_tokens == 5
    assert any(s.generated.segment.finish_reason == "length" for s in out)


def test_stop_string_cuts_at_the_completing_token(bundle):
    eng = TrainsideAREngine(bundle, AREngineConfig(stop_check_interval=1))
    free = eng.generate(_batch(max_new_tokens=12, top_k=1))
    text = free.samples[0].generated.text
    stop = text[3:5]  # a substring the greedy completion is known to produce
    out = eng.generate(_batch(max_new_tokens=12, top_k=1, stop=(stop,)))
    seg = out.samples[0].generated.segment
    tok = bundle.tokenizer
    assert seg.finish_reason == "stop"
    assert stop in tok.decode(seg.response_ids.tolist()) and stop not in tok.decode(seg.response_ids[:-1].tolist())
    free_ids = free.samples[0].generated.segment.response_ids
    assert seg.response_ids.tolist() == free_ids[:seg.num_response_tokens].tolist()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_top_k_1_matches_argmax_of_full_forward(attn):
    # Prompts of different lengths, so the decode loop runs with left padding.
    bundle = build_tiny_lm(seed=0, keep_reference=False, attn_implementation=attn)
    eng = TrainsideAREngine(bundle, AREngineConfig(apply_chat_template=False))
    batch = _batch(n_prompts=1, k=1, max_new_tokens=6, top_k=1)
    batch.samples[0].generated.prompt = "a much longer prompt than the other one"
    out = eng.generate(SampleBatch.concat([batch, _batch(n_prompts=2, k=1, max_new_tokens=6, top_k=1)[1:]]))
    for s in out:
        seg = s.generated.segment
        ids = torch.cat([seg.prompt_ids, seg.response_ids])[None]
        with torch.no_grad():
            logits = bundle.module(ids).logits[0, seg.prompt_ids.numel() - 1:-1]
        assert seg.response_ids.tolist() == logits.argmax(-1).tolist()


def test_sample_next_top_k_top_p_filters_and_logp_is_untruncated():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen_k = {int(sample_next(logits, ARSamplingParams(top_k=2), g)[0]) for _ in range(200)}
    seen_p = {int(sample_next(logits, ARSamplingParams(top_p=0.7), g)[0]) for _ in range(200)}
    assert seen_k == {0, 1} and seen_p == {0, 1}
    ids, lp = sample_next(logits.repeat(64, 1), ARSamplingParams(temperature=2.0, top_p=0.9), g)
    full = torch.log_softmax(logits[0] / 2.0, -1)
    torch.testing.assert_close(lp, full[ids], rtol=0, atol=0)


def test_mixed_sampling_params_are_honoured_per_part(bundle):
    batch = _batch(n_prompts=2, k=2, max_new_tokens=3)
    fast = batch.samples[0].generated
    fast.sampling = ARSamplingParams(max_new_tokens=1)
    out = TrainsideAREngine(bundle).generate(batch)
    assert out.samples[0].generated.segment.num_response_tokens == 1
    assert max(s.generated.segment.num_response_tokens for s in out.samples[1:]) <= 3


def test_rescore_matches_decode_within_kv_cache_drift(bundle):
    batch = _batch(max_new_tokens=8, seed=5)
    rescored = TrainsideAREngine(bundle, AREngineConfig(logp_source="rescore"))
    decoded = TrainsideAREngine(bundle, AREngineConfig(logp_source="decode"))
    a, b = rescored.generate(batch), decoded.generate(batch)
    for sa, sb in zip(a, b):
        assert torch.equal(sa.generated.segment.response_ids, sb.generated.segment.response_ids)
        torch.testing.assert_close(sa.generated.segment.log_probs, sb.generated.segment.log_probs,
                                   atol=1e-5, rtol=0)
    assert rescored.last_decode_rescore_absdiff is not None and rescored.last_decode_rescore_absdiff < 1e-5


def test_rejects_non_ar_parts_and_bad_config(bundle):
    recs = [PromptRecord(prompt_id="p", prompt="x")]
    batch = SampleBatch.from_prompts(recs, samples_per_prompt=1, kind="diffusion", sampling=None)
    with pytest.raises(EngineError, match="kind"):
        TrainsideAREngine(bundle).generate(batch)
    with pytest.raises(ConfigError):
        AREngineConfig(forward_batch_size=0)
