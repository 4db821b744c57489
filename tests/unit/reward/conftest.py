"""Tiny-CLIP fixture for reward tests (built locally from config, no network)."""

import pytest
import torch

from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


def text_batch(texts: list[str]) -> SampleBatch:
    """One prompt with one AR sample per text, each sample's generated text set."""
    batch = SampleBatch.from_prompts([PromptRecord(prompt_id="p", prompt="q")], samples_per_prompt=len(texts),
                                     kind="ar", sampling=ARSamplingParams())
    for s, t in zip(batch, texts):
        s.generated.text = t
    return batch


def _byte_chars() -> list[str]:
    # The printable-byte-to-unicode table of byte-level BPE, so every byte has a token.
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A random-init CLIP (2 layers, width 32, projection 16) + a char-level CLIP tokenizer, saved to disk."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for c in _byte_chars():
            vocab[c + suffix] = len(vocab)
    tok = CLIPTokenizer(vocab=vocab, merges=[])
    proc = CLIPProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32},
                                                               crop_size={"height": 32, "width": 32}), tokenizer=tok)
    torch.manual_seed(0)
    layers = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(vocab), max_position_embeddings=32, bos_token_id=0,
                                      eos_token_id=1, pad_token_id=1, **layers),
                     vision_config=dict(image_size=32, patch_size=8, **layers), projection_dim=16)
    path = tmp_path_factory.mktemp("tiny_clip")
    CLIPModel(cfg).save_pretrained(path)
    proc.save_pretrained(path)
    return str(path)
