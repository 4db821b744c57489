"""Lean decoder vs the transformers forward: same next-token logits (to float tolerance), same greedy tokens."""

import pytest
import torch

from unirl_core.errors import ConfigError
from unirl_core.models.lm import build_tiny_lm
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.rollout.ar_decoder import LeanDecoder, lean_decoder_supported
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


def _model(model_type, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               attention_bias=model_type == "qwen2")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_lean_logits_match_full_forward_with_left_padding(model_type, static):
    """``static``: the fixed-shape step a CUDA graph records (here run eagerly), over a cache with a spare column."""
    model = _model(model_type)
    assert lean_decoder_supported(model)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    extra = torch.tensor([[8, 9], [10, 11]])
    dec = LeanDecoder(model, batch=2, max_len=8 if static else 7, static=static)
    got = [dec.prefill(ids, mask).clone(), dec.step(extra[:, 0]).clone(), dec.step(extra[:, 1]).clone()]
    full_ids = torch.cat([ids, extra], 1)
    full_mask = torch.cat([mask, torch.ones(2, 2, dtype=torch.int64)], 1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(input_ids=full_ids, attention_mask=full_mask, position_ids=pos).logits
    for k, logits in enumerate(got):
        torch.testing.assert_close(logits, ref[:, 4 + k], atol=2e-5, rtol=1e-4)


def test_engine_lean_and_transformers_decoders_agree():
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    recs = [PromptRecord(prompt_id=f"p{i}", prompt="x" * (i + 1) + " =") for i in range(4)]
    batch = SampleBatch.from_prompts(recs, samples_per_prompt=2, kind="ar",
                                     sampling=ARSamplingParams(max_new_tokens=10, seed=3))
    lean = TrainsideAREngine(bundle, AREngineConfig(decoder="lean")).generate(batch)
    hf = TrainsideAREngine(bundle, AREngineConfig(decoder="transformers")).generate(batch)
    for a, b in zip(lean, hf):
        assert torch.equal(a.generated.segment.response_ids, b.generated.segment.response_ids)
        assert torch.equal(a.generated.segment.log_probs, b.generated.segment.log_probs)  # both rescored


def test_unsupported_model_falls_back_or_raises():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert not lean_decoder_supported(gpt2)
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    bundle.module = gpt2
    with pytest.raises(ConfigError, match="decoder"):
        TrainsideAREngine(bundle, AREngineConfig(decoder="lean"))._use_lean(gpt2)
    assert not TrainsideAREngine(bundle)._use_lean(gpt2)


def test_static_step_fills_the_cache_and_then_refuses():
    model = _model("qwen3")
    dec = LeanDecoder(model, batch=1, max_len=4, static=True)
    dec.prefill(torch.tensor([[1, 2]]), torch.tensor([[1, 1]]))
    dec.step(torch.tensor([3]))
    dec.step(torch.tensor([4]))  # columns 2 and 3: the cache is full
    assert int(dec._col) == 4 and bool(dec._open.all())
    with pytest.raises(RuntimeError, match="full"):
        dec.step(torch.tensor([5]))


def test_engine_static_step_samples_the_same_tokens():
    """``engine.cuda_graphs`` on a CPU runs the graph's fixed-shape step eagerly: the same sampled tokens as the
    dynamic lean step here (its logits differ only in float rounding), and the same rescored log-probs."""
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    recs = [PromptRecord(prompt_id=f"p{i}", prompt="x" * (i + 1) + " =") for i in range(4)]
    batch = SampleBatch.from_prompts(recs, samples_per_prompt=2, kind="ar",
                                     sampling=ARSamplingParams(max_new_tokens=12, seed=5))
    plain = TrainsideAREngine(bundle, AREngineConfig(decoder="lean")).generate(batch)
    static = TrainsideAREngine(bundle, AREngineConfig(decoder="lean", cuda_graphs=True)).generate(batch)
    for a, b in zip(plain, static):
        assert torch.equal(a.generated.segment.response_ids, b.generated.segment.response_ids)
        assert torch.equal(a.generated.segment.log_probs, b.generated.segment.log_probs)


def test_cuda_graphs_without_the_lean_decoder_is_refused():
    with pytest.raises(ConfigError, match="engine.cuda_graphs"):
        AREngineConfig(decoder="transformers", cuda_graphs=True)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    with pytest.raises(ConfigError, match="engine.cuda_graphs"):  # auto: a model the lean decoder cannot run
        TrainsideAREngine(bundle, AREngineConfig(cuda_graphs=True))._use_lean(gpt2)


def test_close_frees_the_cache_and_refuses_further_steps():
    model = _model("qwen3")
    dec = LeanDecoder(model, batch=1, max_len=6, static=True)
    dec.prefill(torch.tensor([[1, 2]]), torch.tensor([[1, 1]]))
    dec.step(torch.tensor([3]))
    dec.close()
    dec.close()  # idempotent
    assert dec.k == [] and dec.v == [] and dec._open is None
    with pytest.raises(RuntimeError, match="after close"):
        dec.step(torch.tensor([4]))
    with pytest.raises(RuntimeError, match="after close"):
        dec.prefill(torch.tensor([[1, 2]]), torch.tensor([[1, 1]]))


@pytest.mark.parametrize("fail", [False, True])
def test_engine_closes_every_decoder_it_opens(monkeypatch, fail):
    """One decoder per decode batch, each closed when its batch ends, also when sampling raises: its static cache
    (and on a GPU its graph and cuBLAS workspaces) must not outlive the rollout into the train step's peak."""
    import unirl_core.rollout.ar as ar

    opened = []

    class Tracked(LeanDecoder):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            opened.append(self)

    monkeypatch.setattr(ar, "LeanDecoder", Tracked)
    if fail:
        real = ar.sample_next
        calls = []

        def failing(*a, **k):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("sampling failed")
            return real(*a, **k)

        monkeypatch.setattr(ar, "sample_next", failing)
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    recs = [PromptRecord(prompt_id=f"p{i}", prompt="x" * (i + 1) + " =") for i in range(4)]
    batch = SampleBatch.from_prompts(recs, samples_per_prompt=2, kind="ar",
                                     sampling=ARSamplingParams(max_new_tokens=6, seed=1))
    engine = TrainsideAREngine(bundle, AREngineConfig(decoder="lean", cuda_graphs=True, decode_batch_size=4))
    if fail:
        with pytest.raises(RuntimeError, match="sampling failed"):
            engine.generate(batch)
    else:
        engine.generate(batch)
    assert opened and all(d.closed and d.k == [] for d in opened)
    assert len(opened) == (1 if fail else 2)
