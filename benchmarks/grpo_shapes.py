"""The GRPO recipe benchmark's models, prompts, reward and FLOP count, shared by its sides (``bench_grpo_recipe.py``):
the Qwen3 shapes built at random init from config (no hub), a word-level tokenizer over the real vocabulary, seeded
prompts of a fixed token length, a hash-of-the-text reward both sides score identically, and the model FLOPs of one
step (the numerator of MFU)."""

from __future__ import annotations

import zlib

from common import lm_generate_flops, lm_replay_flops

QWEN3 = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
             rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
SHAPES = {"qwen3-0.6b": QWEN3,
          "qwen3-1.7b": dict(QWEN3, hidden_size=2048, intermediate_size=6144),
          "qwen3-4b": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                           num_attention_heads=32),
          # the real vocabulary and word tokenizer on a 2-layer body: the CPU check of the Qwen3 shapes' code path
          "qwen3-mini": dict(QWEN3, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16)}
EOS, PAD = 151_645, 151_643


def model_flops_per_step(a) -> float | None:
    """Model FLOPs of one GRPO step at the shape, the work both sides must do: generation (prefill of the prompt,
    one decode step per new token) and one forward + backward of every sample (3x a forward), matmuls of the
    decoder and the LM head (on response positions) plus causal attention. Not counted: our rescoring forward and
    recomputation under gradient checkpointing (they are overhead, not model work). Full fine-tune, no CFG."""
    if a.shape not in SHAPES:
        return None
    rows, c = a.prompts * a.group, SHAPES[a.shape]
    return (lm_generate_flops(c, rows, a.prompt_len, a.new_tokens)
            + lm_replay_flops(c, rows, a.prompt_len, a.new_tokens, backward="full"))


def text_reward(text: str) -> float:
    """The benchmark's reward, identical on both sides: a hash of the completion text in [0, 1]."""
    return (zlib.crc32(text.strip().encode()) % 11) / 10


class TextHashScorer:
    def __call__(self, items) -> list[float]:
        return [text_reward(it.text or "") for it in items]


# ----------------------------------------------------------------------------- models and prompts


def build_model(a):
    """``(module, tokenizer)`` of the shape, random init (seed 0), in its dtype on the device."""
    import torch

    dtype = getattr(torch, a.dtype)
    if a.shape == "tiny":
        from unirl_core.models.lm import build_tiny_lm

        bundle = build_tiny_lm(seed=0, keep_reference=False, dtype=a.dtype)
        return bundle.module.to(a.device), bundle.tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[a.shape], pad_token_id=PAD, eos_token_id=EOS, bos_token_id=PAD)
    cfg._attn_implementation = "sdpa"  # LMConfig's default; the engine's lean decoder needs sdpa or eager
    torch.manual_seed(0)
    with torch.device(a.device):
        model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, PAD
    return model.to(dtype).eval(), tokenizer(a.shape)


def tokenizer(shape: str):
    if shape == "tiny":
        from unirl_core.models.tokenizer import load_tokenizer

        return load_tokenizer("tiny")
    from bench_ar_rollout import _word_tokenizer

    return _word_tokenizer(SHAPES[shape]["vocab_size"], EOS, PAD)


def prompt_texts(a, tokenizer, count: int = 64) -> list[str]:
    """``count`` prompts of ``prompt_len`` random non-special tokens (seeded)."""
    import torch

    g = torch.Generator().manual_seed(0)
    special, vocab = set(tokenizer.all_special_ids), len(tokenizer)
    out = []
    while len(out) < count:
        ids = [i for i in torch.randint(0, vocab, (a.prompt_len * 2,), generator=g).tolist() if i not in special]
        text = tokenizer.decode(ids[:a.prompt_len])
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) == a.prompt_len:
            out.append(text)
    return out
