"""The reward actor sends back only the scores; applied on the caller's copy they equal in-process scoring."""

from __future__ import annotations

import math

import pytest

from unirl_core.errors import RewardError
from unirl_core.io.arrow import batch_to_table
from unirl_core.pool.actors import apply_scores, scores_of
from unirl_core.reward import RewardConfig, RewardService
from tests.unit.reward.conftest import text_batch
from unirl_core.types import SampleBatch


def _service() -> RewardService:
    def length(items):
        return [float(len(it.text)) for it in items]

    def picky(items):  # NaN for 'nan': that sample is marked invalid
        return [math.nan if it.text == "nan" else 1.0 for it in items]

    cfg = RewardConfig(components=[("length", 0.5, {}), ("picky", 2.0, {})], failure_policy="mark_invalid")
    return RewardService(cfg, scorers={"length": length, "picky": picky})


def _written(batch: SampleBatch) -> list[tuple]:
    return [(p.sample_id, p.rewards, p.reward, p.valid) for p in batch.generated]


def test_applied_scores_equal_in_process_scoring():
    texts = ["ab", "nan", "abcd"]
    in_process = _service().score(text_batch(texts))
    remote_side = _service().score(text_batch(texts))  # what the actor scored: its own decoded copy
    caller = text_batch(texts)
    assert apply_scores(caller, scores_of(remote_side)) is caller
    assert _written(caller) == _written(in_process)
    assert batch_to_table(caller).equals(batch_to_table(in_process))  # nothing else differs either
    assert [p.valid for p in caller.generated] == [True, False, True] and caller.generated[1].reward is None
    assert caller.generated[0].rewards == {"length": 2.0, "picky": 1.0} and caller.generated[0].reward == 3.0


def test_scores_of_another_batch_are_refused_and_nothing_is_written():
    scores = scores_of(_service().score(text_batch(["ab", "cd"])))
    other = text_batch(["ab", "cd"])
    other.samples[1].generated.sample_id = "elsewhere"
    with pytest.raises(RewardError, match="belong to another batch"):
        apply_scores(other, scores)
    with pytest.raises(RewardError, match="belong to another batch"):
        apply_scores(text_batch(["ab", "cd", "ef"]), scores)
    assert all(p.reward is None and p.rewards == {} for p in other.generated)
