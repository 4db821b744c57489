"""The micro-batch plan shared by the engine's rescoring and the trainer's replay (golden values by hand)."""

import pytest

from unirl_core.errors import ConfigError, InvariantError
from unirl_core.models.micro_batch import (
    padded_tokens,
    plan_micro_batches,
    split_to_count,
    token_lengths,
)

LENGTHS = [(2, 3), (5, 1), (1, 1), (4, 4), (2, 2)]  # (prompt, response); totals 5, 6, 2, 8, 4


def test_fixed_count_is_consecutive_slices():
    assert plan_micro_batches(LENGTHS, size=2, max_tokens=None) == [[0, 1], [2, 3], [4]]


def test_token_budget_golden():
    # longest first: 3 (8), 1 (6), 0 (5), 4 (4), 2 (2); [3]+[1] pads to 2 x (5 + 4) = 18 > 12, [0, 4] is
    # 2 x (2 + 3) = 10, adding 2 makes 3 x 5 = 15 > 12
    assert plan_micro_batches(LENGTHS, size=2, max_tokens=12) == [[3], [1], [0, 4], [2]]
    assert plan_micro_batches(LENGTHS, size=2, max_tokens=1000) == [[3, 1, 0, 4, 2]]


def test_token_budget_bounds_and_covers():
    lengths = [((7 * i) % 13 + 1, (5 * i) % 17 + 1) for i in range(50)]
    for budget in (20, 64, 200):
        plan = plan_micro_batches(lengths, size=4, max_tokens=budget)
        assert sorted(i for mb in plan for i in mb) == list(range(50))
        assert all(len(mb) == 1 or padded_tokens(lengths, mb) <= budget for mb in plan)
        assert plan == plan_micro_batches(list(lengths), size=4, max_tokens=budget)  # deterministic


def test_a_sample_over_budget_runs_alone():
    assert plan_micro_batches([(4, 4), (1, 1)], size=2, max_tokens=5) == [[0], [1]]


def test_non_token_segments_name_the_knob():
    with pytest.raises(ConfigError, match="train.micro_batch_tokens"):
        token_lengths([object()])
    with pytest.raises(ConfigError, match="max_tokens"):
        plan_micro_batches(LENGTHS, size=2, max_tokens=0)


def test_split_to_count_halves_the_fullest_first():
    assert split_to_count([[3], [1, 0, 4, 2]], 4) == [[3], [1], [0], [4, 2]]
    plan = split_to_count([[0, 1, 2, 3, 4]], 5)
    assert plan == [[0], [1], [2], [3], [4]]
    with pytest.raises(InvariantError, match="count"):
        split_to_count([[0, 1]], 3)
