"""Chunked token log-probs (``replay_log_probs``) against the full-vocabulary reference, and LM gradient
checkpointing: same values within fp32 rounding, same gradients within tolerance, bitwise agreement between
the grad and no-grad forwards (what makes the first update's ratio exactly 1), no [B, R, V] tensor kept for
backward."""

import logging

import pytest
import torch

from unirl_core.errors import ConfigError
from unirl_core.models.lm import (CHUNKED_HEAD_MODELS, LMConfig, build_layout, build_tiny_lm, replay_log_probs,
                                  replay_log_probs_full)
from unirl_core.types import TokenSegment

LENGTHS = [(3, 5), (7, 2), (1, 9), (4, 6)]  # (prompt, response): 22 valid response tokens, R = 9


def _layout(bundle, seed=0, lengths=LENGTHS, temps=(1.0, 0.7, 1.3, 0.9)):
    g = torch.Generator().manual_seed(seed)
    segs = []
    for p, r in lengths:
        segs.append(TokenSegment(prompt_ids=torch.randint(0, 250, (p,), generator=g),
                                 response_ids=torch.randint(0, 250, (r,), generator=g),
                                 log_probs=torch.zeros(r), response_mask=torch.ones(r, dtype=torch.bool)))
    return build_layout(segs, list(temps[:len(segs)]), pad_id=bundle.pad_token_id)


def _activate_lora(bundle, seed=1):
    """LoRA starts as a no-op (lora_B = 0, lora_A unseeded); give both adapters seeded values so two bundles
    agree and the gradients are non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bundle.module.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _grads(bundle, fn, weights):
    bundle.module.zero_grad(set_to_none=True)
    logp, _ = fn()
    (logp * weights).sum().backward()
    return {n: p.grad.clone() for n, p in bundle.module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("finetune", ["full", "lora"])
@pytest.mark.parametrize("chunk", [1, 5, 7, 22, 1024])
def test_chunked_matches_full_logits_values_and_gradients(finetune, chunk):
    bundle = build_tiny_lm(seed=0, finetune=finetune, keep_reference=False, lora_rank=4)
    if finetune == "lora":
        _activate_lora(bundle)
    lay = _layout(bundle)
    with torch.no_grad():
        lp, ent = replay_log_probs(bundle.module, lay, with_entropy=True, chunk_tokens=chunk)
        lp_full, ent_full = replay_log_probs_full(bundle.module, lay, with_entropy=True)
    assert lp.shape == ent.shape == lay.targets.shape and lp.dtype == torch.float32
    torch.testing.assert_close(lp, lp_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_full, atol=1e-5, rtol=1e-5)
    assert bool((lp[~lay.valid] == 0).all()) and bool((ent[~lay.valid] == 0).all())

    w = torch.randn(lay.targets.shape, generator=torch.Generator().manual_seed(3))
    g_chunk = _grads(bundle, lambda: replay_log_probs(bundle.module, lay, with_entropy=True, chunk_tokens=chunk), w)
    g_full = _grads(bundle, lambda: replay_log_probs_full(bundle.module, lay), w)
    assert g_chunk.keys() == g_full.keys() and g_chunk
    if finetune == "full":  # tied head: the embedding matrix gets the head's gradient too
        assert bundle.module.lm_head.weight is bundle.module.model.embed_tokens.weight
        assert "model.embed_tokens.weight" in g_chunk
    for name in g_full:
        torch.testing.assert_close(g_chunk[name], g_full[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grad_and_no_grad_replays_are_bitwise_equal(dtype):
    """pi_old (no grad) and the loss forward (grad, checkpointed chunks) give the same bits: ratio == 1."""
    bundle = build_tiny_lm(seed=0, dtype=dtype, keep_reference=False)
    lay = _layout(bundle)
    with bundle.compute():
        with torch.no_grad():
            old, _ = replay_log_probs(bundle.module, lay, chunk_tokens=5)
        new, ent = replay_log_probs(bundle.module, lay, with_entropy=True, chunk_tokens=5)
    assert new.requires_grad and not ent.requires_grad
    assert torch.equal(old, new.detach())
    assert bool((torch.exp(new - old)[lay.valid] == 1.0).all())


def test_no_vocab_sized_tensor_is_saved_for_backward():
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    lay = _layout(bundle)
    vocab = bundle.module.config.vocab_size
    n_tokens = int(lay.valid.sum())

    def logits_like_saved(fn):
        """numel of every tensor saved for backward whose last dimension is the vocabulary (logits-shaped)."""
        sizes = []

        def pack(t):
            if t.dim() >= 1 and t.shape[-1] == vocab:
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sizes

    full = logits_like_saved(lambda: replay_log_probs_full(bundle.module, lay, with_entropy=True))
    assert max(full) >= n_tokens * vocab  # the full path keeps [B, R, V] log-softmax for backward
    # the chunked one keeps nothing logits-shaped outside its checkpointed chunks
    assert logits_like_saved(lambda: replay_log_probs(bundle.module, lay, with_entropy=True, chunk_tokens=4)) == []
    w = torch.ones_like(lay.targets, dtype=torch.float32)
    (replay_log_probs(bundle.module, lay, chunk_tokens=4)[0] * w).sum().backward()  # recompute works


def test_unknown_model_class_falls_back_to_full_logits(caplog):
    from transformers import Qwen3ForCausalLM

    class CustomLM(Qwen3ForCausalLM):
        def forward(self, *args, **kwargs):  # could transform logits: the chunked path must not assume it does not
            return super().forward(*args, **kwargs)

    bundle = build_tiny_lm(seed=0, keep_reference=False)
    bundle.module.__class__ = CustomLM
    assert "CustomLM" not in CHUNKED_HEAD_MODELS
    lay = _layout(bundle)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="unirl_core.models.lm"):
        lp, ent = replay_log_probs(bundle.module, lay, with_entropy=True)
        lp_full, ent_full = replay_log_probs_full(bundle.module, lay, with_entropy=True)
    assert "full-vocabulary" in caplog.text
    assert torch.equal(lp, lp_full) and torch.equal(ent, ent_full)


def test_head_is_restored_after_a_failing_forward():
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    head = bundle.module.lm_head
    lay = _layout(bundle)
    lay.input_ids = lay.input_ids.float()  # the embedding lookup fails
    with pytest.raises(RuntimeError):
        replay_log_probs(bundle.module, lay)
    assert bundle.module.lm_head is head


def test_chunk_size_validation():
    with pytest.raises(ConfigError, match="logprob_chunk_tokens"):
        LMConfig(logprob_chunk_tokens=0)
    with pytest.raises(ConfigError, match="logprob_chunk_tokens"):
        LMConfig(logprob_chunk_tokens=True)
    bundle = build_tiny_lm(seed=0, keep_reference=False, logprob_chunk_tokens=7)
    assert bundle.logprob_chunk_tokens == 7
    with pytest.raises(ConfigError, match="chunk_tokens"):
        replay_log_probs(bundle.module, _layout(bundle), chunk_tokens=0)


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_gradient_checkpointing_same_values_and_gradients(finetune):
    plain = build_tiny_lm(seed=0, finetune=finetune, keep_reference=False, lora_rank=4)
    ckpt = build_tiny_lm(seed=0, finetune=finetune, keep_reference=False, lora_rank=4, gradient_checkpointing=True)
    if finetune == "lora":
        _activate_lora(plain)
        _activate_lora(ckpt)
    assert ckpt.module.is_gradient_checkpointing and not plain.module.is_gradient_checkpointing
    assert not ckpt.module.training  # the bundle stays in eval mode
    lay = _layout(plain)
    layer = ckpt.module.model.layers[0]
    calls = []
    layer.register_forward_pre_hook(lambda *_: calls.append(1))  # (recompute stops early: no post-hook)
    with torch.no_grad():
        a, _ = replay_log_probs(plain.module, lay, chunk_tokens=5)
        b, _ = replay_log_probs(ckpt.module, lay, chunk_tokens=5)
    assert torch.equal(a, b) and len(calls) == 1
    w = torch.randn(lay.targets.shape, generator=torch.Generator().manual_seed(3))
    g_plain = _grads(plain, lambda: replay_log_probs(plain.module, lay, chunk_tokens=5), w)
    calls.clear()
    g_ckpt = _grads(ckpt, lambda: replay_log_probs(ckpt.module, lay, chunk_tokens=5), w)
    assert len(calls) == 2  # forward + recompute in backward: checkpointing is active
    assert not layer.training and not ckpt.module.training  # the flag was raised for the forward only
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_checkpointing_first_update_ratio_is_exact(dtype, tmp_path):
    """The shipped loop with lm.model.gradient_checkpointing=true: every step's first update has ratio 1."""
    from unirl_core.config import load_recipe
    from unirl_core.loop.local import run_local
    from tests.unit.loop.test_exactness_matrix import RECIPES, assert_exact, overrides

    torch.set_num_threads(1)
    cfg = load_recipe(RECIPES["lm"], overrides("lm", dtype, "full", "never", tmp_path)
                      + ["lm.model.gradient_checkpointing=true", "lm.model.logprob_chunk_tokens=16"])
    assert cfg.lm.model.gradient_checkpointing and cfg.lm.model.logprob_chunk_tokens == 16
    assert_exact(run_local(cfg))
