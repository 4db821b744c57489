"""assign_advantages: invalid samples excluded and counted, zero-std groups dropped, values written."""

import math

import pytest

from unirl_core.advantage import (
    AdvantageConfig,
    PerPromptStatTracker,
    StatTrackerConfig,
    assign_advantages,
    drop_zero_std_groups,
)
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


def _batch(rewards: dict[str, list[float | None]]) -> SampleBatch:
    prompts = [PromptRecord(prompt_id=k, prompt=f"prompt {k}") for k in rewards]
    n = len(next(iter(rewards.values())))
    batch = SampleBatch.from_prompts(prompts, samples_per_prompt=n, kind="ar", sampling=ARSamplingParams())
    for s in batch:
        r = rewards[s.group_id][int(s.sample_id.split("/")[1])]
        s.generated.reward = r
        s.generated.valid = r is not None
    return batch


def test_invalid_excluded_and_zero_std_group_dropped():
    batch = _batch({"p": [0.0, 1.0, None], "q": [2.0, 2.0, 2.0], "r": [4.0, 2.0, 3.0]})
    out, stats = assign_advantages(batch, AdvantageConfig(eps=0.0, drop_zero_std_groups=True))
    assert [s.sample_id for s in out] == ["p/0", "p/1", "r/0", "r/1", "r/2"]
    # p: {0, 1} -> -1, 1; r: mean 3, std sqrt(2/3) -> 1/sqrt(2/3) = 1.22474487
    assert [s.generated.advantage for s in out] == pytest.approx([-1, 1, 1.22474487, -1.22474487, 0], abs=1e-8)
    assert batch.samples[2].generated.advantage is None  # invalid, excluded
    assert all(batch.samples[i].generated.advantage is None for i in (3, 4, 5))  # dropped group
    assert (stats.num_samples, stats.num_invalid, stats.num_groups) == (9, 1, 3)
    assert (stats.num_groups_dropped_zero_std, stats.num_samples_dropped_zero_std, stats.num_kept) == (1, 3, 5)
    assert stats.reward_mean == pytest.approx(16 / 8)
    assert stats.as_metrics()["advantage/num_invalid"] == 1.0


def test_without_filter_constant_group_kept_at_zero_and_nan_reward_invalid():
    batch = _batch({"q": [2.0, 2.0], "p": [1.0, float("nan")]})
    out, stats = assign_advantages(batch, AdvantageConfig())
    assert [s.sample_id for s in out] == ["q/0", "q/1", "p/0"]
    assert [s.generated.advantage for s in out] == [0.0, 0.0, 0.0]
    assert stats.num_invalid == 1 and stats.num_groups_dropped_zero_std == 0


def test_clip_count_and_tracker_path():
    batch = _batch({"p": [0.0] * 9 + [1.0]})
    _, stats = assign_advantages(batch, AdvantageConfig(eps=0.0, clip=2.0))
    assert stats.num_clipped == 1 and stats.advantage_abs_max == 2.0
    tracker = PerPromptStatTracker(StatTrackerConfig(buffer_size=4, min_count=2))
    out, _ = assign_advantages(_batch({"p": [1.0, 3.0]}), AdvantageConfig(eps=0.0), tracker)
    assert [s.generated.advantage for s in out] == [-1.0, 1.0]
    assert tracker.history("prompt p") == [1.0, 3.0]


def test_all_invalid_gives_empty_batch_and_nan_stats():
    out, stats = assign_advantages(_batch({"p": [None, None]}), AdvantageConfig())
    assert len(out) == 0 and stats.num_invalid == 2 and math.isnan(stats.reward_mean)


def test_drop_zero_std_groups_alone():
    batch = _batch({"p": [0.0, 1.0], "q": [2.0, 2.0], "r": [None, 5.0]})
    out, dropped = drop_zero_std_groups(batch)
    # q is constant; r has a single valid sample (std 0) -> both dropped; the invalid r/0 goes too
    assert [s.sample_id for s in out] == ["p/0", "p/1"] and dropped == 2
    assert drop_zero_std_groups(_batch({"p": [None]}))[1] == 0
