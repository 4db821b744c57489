"""Tiny-CLIP fixture for reward tests (built locally from config, no network)."""

import pytest

from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


def text_batch(texts: list[str]) -> SampleBatch:
    """One prompt with one AR sample per text, each sample's generated text set."""
    batch = SampleBatch.from_prompts([PromptRecord(prompt_id="p", prompt="q")], samples_per_prompt=len(texts),
                                     kind="ar", sampling=ARSamplingParams())
    for s, t in zip(batch, texts):
        s.generated.text = t
    return batch


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A random-init CLIP (2 layers, width 32, projection 16) + a char-level CLIP tokenizer, saved to disk."""
    from unirl_core.config.rehearsal import tiny_clip

    return str(tiny_clip(tmp_path_factory.mktemp("tiny_clip")))
