"""The AR engine's defaults are the fast path where it applies: CUDA-graph decode and a decode batch sized from
device memory on a GPU, the CPU unchanged (so CPU runs keep their trajectories); the replay chunk follows the
vocabulary, the same for the engine's recording and the trainer's replay."""

from __future__ import annotations

import logging

import pytest
import torch

from unirl_core.errors import ConfigError
from unirl_core.models.lm import DEFAULT_LOGPROB_CHUNK_TOKENS, auto_logprob_chunk_tokens, build_tiny_lm
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


@pytest.mark.parametrize("vocab, chunk", [(303, 1024), (32_000, 1024), (65_536, 1024), (65_537, 512),
                                          (151_936, 256), (262_144, 256), (10_000_000, 64)])
def test_replay_chunk_follows_the_vocabulary(vocab, chunk):
    assert auto_logprob_chunk_tokens(vocab) == chunk
    assert chunk * vocab * 4 <= 256 * 2**20 or chunk == 64


def test_a_set_chunk_wins_and_unset_is_sized_from_the_model():
    torch.set_num_threads(1)
    assert build_tiny_lm(seed=0, keep_reference=False, logprob_chunk_tokens=7).logprob_chunk_tokens == 7
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    assert bundle.config.logprob_chunk_tokens is None
    assert bundle.logprob_chunk_tokens == auto_logprob_chunk_tokens(bundle.module.config.vocab_size)
    assert bundle.logprob_chunk_tokens == DEFAULT_LOGPROB_CHUNK_TOKENS  # tiny vocab: the old default, same bits


def _batch(n: int) -> SampleBatch:
    prompts = [PromptRecord(prompt_id=f"p{i}", prompt=f"{i} plus {i}") for i in range(n)]
    return SampleBatch.from_prompts(prompts, samples_per_prompt=1, kind="ar",
                                    sampling=ARSamplingParams(max_new_tokens=4, seed=3), policy_version=0,
                                    metadata={})


def test_on_a_cpu_the_defaults_decode_as_before(caplog):
    """Unset decode_batch_size / cuda_graphs on a CPU: forward_batch_size rows, eager dynamic step (one log line),
    and bitwise the tokens of the explicit settings CPU runs were recorded with."""
    torch.set_num_threads(1)
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    auto = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=2))
    assert auto.decode_width(5, 8, 4) == 2
    with caplog.at_level(logging.INFO, logger="unirl_core.rollout.ar"):
        a = auto.generate(_batch(5))
        auto.generate(_batch(5))
    assert caplog.text.count("engine.cuda_graphs=auto: the decode step runs eager") == 1
    assert auto.last_decode_width == 2
    explicit = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=2, decode_batch_size=2, cuda_graphs=False))
    b = explicit.generate(_batch(5))
    for x, y in zip(a.generated, b.generated, strict=True):
        assert torch.equal(x.segment.response_ids, y.segment.response_ids)
        assert torch.equal(x.segment.log_probs, y.segment.log_probs)


def test_a_set_decode_batch_size_is_kept():
    torch.set_num_threads(1)
    engine = TrainsideAREngine(build_tiny_lm(seed=0, keep_reference=False),
                               AREngineConfig(forward_batch_size=2, decode_batch_size=3))
    assert engine.decode_width(10, 8, 4) == 3
    engine.generate(_batch(2))
    assert engine.last_decode_width == 2  # fewer rows than the width


def test_cuda_graphs_true_is_still_refused_with_the_transformers_decoder():
    with pytest.raises(ConfigError, match="engine.cuda_graphs=True"):
        AREngineConfig(cuda_graphs=True, decoder="transformers")
    AREngineConfig(decoder="transformers")  # unset: the transformers decoder simply runs without graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU sizing runs on a CUDA device (device benchmark)")
def test_on_a_gpu_the_decode_batch_is_sized_from_free_memory():
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    bundle.module.to("cuda")
    engine = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=4))
    width = engine.decode_width(64, 16, 16)
    assert width % 4 == 0 and 4 <= width <= 64 and width == 64  # a tiny model's KV cache fits every row
