"""DAPO dynamic sampling: flat groups dropped, extra rounds refill, the batch keeps its size, ratio stays 1."""

import pytest
import torch

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.advantage.dynamic_sampling import FilterGroupsConfig, fill_groups, split_groups
from unirl_core.loop.local import run_local
from unirl_core.types import Part, Sample, SampleBatch

torch.set_num_threads(1)


def _batch(tag: str, rewards: list[list[float | None]]) -> SampleBatch:
    samples = []
    for g, rs in enumerate(rewards):
        for k, r in enumerate(rs):
            sid, gid = f"{tag}{g}/{k}", f"{tag}{g}"
            part = Part(kind="ar", sample_id=sid, group_id=gid, prompt=gid, reward=r, valid=r is not None)
            samples.append(Sample(sample_id=sid, group_id=gid, parts=[part]))
    return SampleBatch(samples=samples, metadata={"step": "1"})


def _groups(batch: SampleBatch) -> list[str]:
    return list(batch.groups())


def test_split_groups_counts_only_valid_rewards():
    b = _batch("a", [[0.0, 1.0], [1.0, 1.0], [1.0, None], [None, None], [0.5, 0.5 + 1e-9]])
    keep, drop = split_groups(b, atol=1e-6)
    assert keep == [[0, 1]] and drop == [[2, 3], [4, 5], [6, 7], [8, 9]]


def test_refill_until_full_then_stop():
    calls = []

    def more(r):
        calls.append(r)
        return _batch(f"r{r}-", [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])

    out, m = fill_groups(_batch("a", [[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]), more, groups=3, max_rounds=5, atol=1e-6)
    assert calls == [1]  # one extra round brings two groups with spread
    assert _groups(out) == ["a0", "r1-1", "r1-2"] and len(out) == 6
    assert m == {"filter_groups/rounds": 2.0, "filter_groups/dropped_groups": 3.0,
                 "filter_groups/kept_first_round": 1.0, "filter_groups/refilled_groups": 2.0,
                 "filter_groups/padded_groups": 0.0}
    assert out.metadata == {"step": "1"}


def test_rounds_run_out_and_flat_groups_pad_in_generation_order():
    out, m = fill_groups(_batch("a", [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]),
                         lambda r: _batch(f"r{r}-", [[1.0, 1.0]] * 3), groups=3, max_rounds=2, atol=1e-6)
    assert _groups(out) == ["a1", "a0", "a2"]
    assert m["filter_groups/rounds"] == 2.0 and m["filter_groups/padded_groups"] == 2.0
    assert m["filter_groups/refilled_groups"] == 0.0 and m["filter_groups/dropped_groups"] == 5.0


def test_full_first_round_draws_nothing_more():
    def more(r):
        raise AssertionError("no extra round needed")

    first = _batch("a", [[0.0, 1.0], [0.2, 0.1]])
    out, m = fill_groups(first, more, groups=2, max_rounds=4, atol=1e-6)
    assert [s.sample_id for s in out] == [s.sample_id for s in first] and m["filter_groups/rounds"] == 1.0


def test_first_batch_must_be_the_whole_step():
    from unirl_core.errors import InvariantError

    with pytest.raises(InvariantError, match=r"filter_groups first batch=1: expected 2 groups"):
        fill_groups(_batch("a", [[0.0, 1.0]]), lambda r: None, groups=2, max_rounds=2, atol=1e-6)


@pytest.mark.parametrize("override, message", [
    (["filter_groups={}"], r"train.old_logp_source='rollout': expected 'replay' with filter_groups"),
    (["filter_groups={}", "train.old_logp_source=replay", "advantage.drop_zero_std_groups=true"],
     r"advantage.drop_zero_std_groups=True: expected False with filter_groups"),
    (["filter_groups={max_num_gen_batches: 0}", "train.old_logp_source=replay"],
     r"filter_groups.max_num_gen_batches=0: expected an integer in \[1, 256\]"),
])
def test_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny-grpo", override)


@pytest.mark.parametrize("shards", [1, 2])
def test_tiny_run_keeps_batch_size_and_exact_first_ratio(tmp_path, shards):
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=3", "train.old_logp_source=replay",
                                    "filter_groups={max_num_gen_batches: 3}", "report.tensorboard=false",
                                    f"loop.rollout_shards={shards}"])
    assert cfg.filter_groups == FilterGroupsConfig(max_num_gen_batches=3)
    sizes, groups = [], []

    def seen(m, b):
        sizes.append((len(b), len(b.groups())))
        groups.append(list(b.groups()))

    hist = run_local(cfg, on_step=seen, progress=False)
    assert sizes == [(32, 4)] * 3
    ids = [g for h in groups for g in h]
    assert len(ids) == len(set(ids)) and any("r1-" in g for g in ids)  # refill groups carry their round
    for h in hist:
        assert h["train/ratio_mean"] == 1.0 and h["train/logp_absdiff_max"] == 0.0
        assert 1.0 <= h["filter_groups/rounds"] <= 3.0
        assert h["filter_groups/kept_first_round"] + h["filter_groups/refilled_groups"] \
            + h["filter_groups/padded_groups"] == 4.0
    assert sum(h["filter_groups/rounds"] for h in hist) > 3  # the untrained model gives flat groups to refill
