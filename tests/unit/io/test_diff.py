"""first_difference: bitwise batch comparison, fields walked in phase order (rollout, reward, advantage, metadata)."""

from __future__ import annotations

import torch

from unirl_core.io.diff import first_difference, same_bits
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


def _batch() -> SampleBatch:
    b = SampleBatch.from_prompts([PromptRecord(prompt_id="p0", prompt="1+1="), PromptRecord(prompt_id="p1",
                                  prompt="2+2=")], samples_per_prompt=2, kind="ar", sampling=ARSamplingParams(),
                                 metadata={"step": "3"})
    for i, p in enumerate(b.generated):
        p.text, p.reward, p.advantage = str(i), float(i), float(i) - 1.5
        p.rewards = {"toy": float(i)}
        p.conditions = {"x": torch.arange(3, dtype=torch.float32) + i}
    return b


def test_equal_batches_have_no_difference():
    assert first_difference(_batch(), _batch()) is None


def test_the_earliest_phase_is_named_first():
    a, b = _batch(), _batch()
    b.generated[3].advantage = 9.0  # advantage of the last row ...
    b.generated[2].reward = 7.0  # ... reward of an earlier one ...
    b.generated[3].text = "changed"  # ... and a rollout field of the last: the rollout field is reported
    d = first_difference(a, b)
    assert (d.field, d.where, d.stored, d.replayed) == ("text", "sample 'p1/1' part 0", "3", "changed")
    b.generated[3].text = "3"
    assert first_difference(a, b).field == "reward"
    b.generated[3].rewards = {"toy": 8.0}
    assert first_difference(a, b).field == "rewards"  # the per-component map comes before the total
    b.generated[2].reward = 2.0
    b.generated[3].rewards = {"toy": 3.0}
    assert first_difference(a, b).field == "advantage"


def test_tensors_by_bytes_floats_by_bits_and_metadata_last():
    a, b = _batch(), _batch()
    b.generated[0].conditions = {"x": torch.arange(3, dtype=torch.float64)}  # same values, another dtype
    assert first_difference(a, b).field == "conditions"
    assert not same_bits(0.0, -0.0) and same_bits(float("nan"), float("nan"))
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    c = _batch()
    c.metadata["step"] = "4"
    assert first_difference(a, c).field == "metadata['step']"
    assert first_difference(a, c, ignore_metadata=("step",)) is None
    c.samples.pop()
    assert first_difference(a, c).field == "samples"
