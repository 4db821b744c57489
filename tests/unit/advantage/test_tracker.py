"""Per-prompt stat tracker: golden values across steps and a JSON round trip."""

import json

import pytest
import torch

from unirl_core.advantage import AdvantageConfig, PerPromptStatTracker, StatTrackerConfig
from unirl_core.errors import CheckpointError, ConfigError

CFG = AdvantageConfig(eps=0.0)


def _step1(tracker):
    return tracker.advantages(["a", "a", "b"], torch.tensor([1.0, 3.0, 5.0], dtype=torch.float64), CFG).tolist()


def test_history_vs_batch_fallback_and_ring_buffer():
    t = PerPromptStatTracker(StatTrackerConfig(buffer_size=3, min_count=2))
    # 'a' has 2 >= min_count rewards {1, 3}: mean 2 std 1. 'b' has 1: batch mean 3, std sqrt(8/3)
    assert _step1(t) == pytest.approx([-1.0, 1.0, 2 / (8 / 3) ** 0.5], abs=1e-12)
    # 'a' buffer keeps the last 3: {3, 5, 5}: mean 13/3, population std sqrt(8/9) -> (5 - 13/3)/sqrt(8/9)
    got = t.advantages(["a", "a"], torch.tensor([5.0, 5.0], dtype=torch.float64), CFG).tolist()
    assert got == pytest.approx([0.70710678, 0.70710678], abs=1e-8)
    assert t.history("a") == [3.0, 5.0, 5.0] and t.history("b") == [5.0]


def test_state_dict_json_round_trip_continues_identically():
    a = PerPromptStatTracker(StatTrackerConfig(buffer_size=3, min_count=2))
    _step1(a)
    b = PerPromptStatTracker.from_state_dict(json.loads(json.dumps(a.state_dict())))
    nxt = torch.tensor([5.0, 0.0], dtype=torch.float64)
    assert a.advantages(["a", "b"], nxt, CFG).tolist() == b.advantages(["a", "b"], nxt, CFG).tolist()
    assert b.cfg == a.cfg and len(b) == 2


def test_state_dict_rejects_damage():
    with pytest.raises(CheckpointError):
        PerPromptStatTracker.from_state_dict({"buffers": {}})
    state = PerPromptStatTracker(StatTrackerConfig()).state_dict()
    state["buffers"] = {"a": [1.0, float("nan")]}
    with pytest.raises(CheckpointError, match="buffers"):
        PerPromptStatTracker.from_state_dict(state)


def test_config_validation():
    with pytest.raises(ConfigError, match="min_count"):
        StatTrackerConfig(buffer_size=4, min_count=5)
