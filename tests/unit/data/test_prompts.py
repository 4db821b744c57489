"""Prompt data sets: jsonl / parquet / HF datasets dir, deterministic per-step shuffling, toy task."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unirl_core.data import (PromptDataConfig, PromptDataset, ToyArithmeticConfig, load_prompts,
                             toy_arithmetic_prompts, toy_arithmetic_reward)
from unirl_core.data.prompts import check_prompts_per_step
from unirl_core.errors import ConfigError, InvariantError
from unirl_core.types import PromptRecord

ROWS = [{"question": f"q{i}", "answer": i * 2, "uid": f"u{i}"} for i in range(5)]


def _check(ds):
    assert len(ds) == 5
    assert ds.records[0] == PromptRecord(prompt_id="u0", prompt="q0", targets={"answer": "0"})


def test_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    _check(load_prompts(PromptDataConfig(path=str(path), prompt_field="question", id_field="uid")))


def test_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    _check(load_prompts(PromptDataConfig(path=str(path), prompt_field="question", id_field="uid")))


def test_hf_datasets_dir_with_split(tmp_path):
    import datasets
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "ds"))
    cfg = PromptDataConfig(path=str(tmp_path / "ds"), prompt_field="question", id_field="uid", split="train")
    _check(load_prompts(cfg))
    with pytest.raises(ConfigError, match="split"):
        load_prompts(PromptDataConfig(path=str(tmp_path / "ds"), prompt_field="question"))


def test_missing_fields_and_bad_formats(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(InvariantError, match="answer"):
        load_prompts(PromptDataConfig(path=str(path)))
    assert load_prompts(PromptDataConfig(path=str(path), answer_field=None)).records[0].targets == {}
    with pytest.raises(InvariantError, match="question"):
        load_prompts(PromptDataConfig(path=str(path), prompt_field="question", answer_field=None))
    (tmp_path / "p.csv").write_text("prompt\nx\n")
    with pytest.raises(ConfigError, match="jsonl"):
        load_prompts(PromptDataConfig(path=str(tmp_path / "p.csv")))
    dup = tmp_path / "d.jsonl"
    dup.write_text("\n".join(json.dumps({"prompt": "x", "id": 1}) for _ in range(2)))
    with pytest.raises(InvariantError, match="unique"):
        load_prompts(PromptDataConfig(path=str(dup), id_field="id", answer_field=None))


def test_per_step_batches_are_deterministic_epoch_permutations():
    recs = [PromptRecord(prompt_id=str(i), prompt=str(i)) for i in range(10)]
    a, b = PromptDataset(recs, seed=3), PromptDataset(recs, seed=3)
    assert [r.prompt_id for r in a.batch(7, 4)] == [r.prompt_id for r in b.batch(7, 4)]
    epoch0 = [r.prompt_id for s in range(5) for r in a.batch(s, 2)]
    epoch1 = [r.prompt_id for s in range(5, 10) for r in a.batch(s, 2)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(str(i) for i in range(10))
    assert epoch0 != epoch1 and epoch0 != sorted(epoch0, key=int)
    assert [r.prompt_id for r in PromptDataset(recs, seed=4).batch(0, 10)] != epoch0
    assert [r.prompt_id for r in PromptDataset(recs, shuffle=False).batch(1, 3)] == ["3", "4", "5"]


def _dataset(size, seed=0, shuffle=True):
    return PromptDataset([PromptRecord(prompt_id=str(i), prompt=str(i)) for i in range(size)], seed=seed,
                         shuffle=shuffle)


def _stream(ds, n, steps):
    return [int(r.prompt_id) for s in range(steps) for r in ds.batch(s, n)]


def _old_stream(ds, n, steps):
    """The sampler before steps spanning two epochs were made repeat-free: plain per-epoch shuffles."""
    size = len(ds)
    return [int(ds.records[ds._order(k // size)[k % size]].prompt_id) for k in range(steps * n)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_no_step_repeats_a_prompt_and_every_epoch_is_a_permutation(shuffle):
    for size in range(1, 14):
        for n in range(1, size + 1):
            for seed in range(3):
                ds = _dataset(size, seed, shuffle)
                stream = _stream(ds, n, 60)
                for s in range(60):
                    assert len(set(stream[s * n:(s + 1) * n])) == n, (size, n, seed, s)
                for e in range(len(stream) // size):
                    assert sorted(stream[e * size:(e + 1) * size]) == list(range(size)), (size, n, seed, e)


@pytest.mark.parametrize(("size", "n"), [(8, 4), (12, 4), (16, 4), (9, 3), (10, 5), (6, 6), (7, 1), (64, 8)])
def test_prompt_counts_that_are_multiples_of_prompts_per_step_keep_the_plain_shuffles(size, n):
    for seed in range(4):
        ds = _dataset(size, seed)
        assert _stream(ds, n, 50) == _old_stream(ds, n, 50)
        # Any step alone (a resumed run's, a refill round's far down the stream) gives the same prompts.
        for step in (0, 7, 1 << 24, (1 << 24) + 12345):
            assert [r.prompt_id for r in _dataset(size, seed).batch(step, n)] == \
                [ds.records[ds._order(k // size)[k % size]].prompt_id for k in range(step * n, (step + 1) * n)]


def test_a_step_spanning_two_epochs_no_longer_repeats_a_prompt():
    size, n, steps = 5, 4, 50  # e.g. 7,473 prompts at 32 per step: most boundaries fall inside a step
    for seed in range(20):
        ds = _dataset(size, seed)
        old, new = _old_stream(ds, n, steps), _stream(ds, n, steps)
        if all(len(set(old[s * n:(s + 1) * n])) == n for s in range(steps)):
            continue
        assert new != old
        for e in range(len(new) // size):
            lo, hi = e * size, (e + 1) * size
            # Only the head of an epoch moves, and only where a step spans its start (e*size % n != 0).
            assert new[lo + n:hi] == old[lo + n:hi]
            assert sorted(new[lo:lo + n]) == sorted(old[lo:lo + n])
            if e * size % n == 0:
                assert new[lo:hi] == old[lo:hi]
        break
    else:
        raise AssertionError("no seed made the old sampler repeat a prompt")


def test_steps_are_the_same_whichever_steps_were_computed_before():
    for size, n in [(5, 4), (7, 4), (10, 7), (33, 8), (100, 32)]:
        ds = _dataset(size, seed=1)
        forward = [[r.prompt_id for r in ds.batch(s, n)] for s in range(40)]
        backward = [[r.prompt_id for r in _dataset(size, seed=1).batch(s, n)] for s in reversed(range(40))]
        assert forward == backward[::-1]
        far = (1 << 24) + 999
        assert [r.prompt_id for r in _dataset(size, seed=1).batch(far, n)] == \
            [r.prompt_id for r in ds.batch(far, n)]
        assert len({r.prompt_id for r in ds.batch(far, n)}) == n


def test_a_step_needs_at_least_prompts_per_step_prompts():
    check_prompts_per_step(4, 4, "data.prompts")
    check_prompts_per_step(4, 7473, "data.prompts")
    with pytest.raises(ConfigError) as info:
        check_prompts_per_step(4, 3, "data.prompts")
    assert str(info.value) == ("data.prompts_per_step=4: expected at most the number of prompts (3 in data.prompts): "
                               "a step takes 4 distinct prompts, so with 3 every step would draw a prompt twice and "
                               "its sample ids collide; set data.prompts_per_step to at most 3, or add prompts to "
                               "data.prompts")


@pytest.mark.parametrize(("rows", "shuffle", "ok"), [(8, True, True), (5, True, True), (4, False, True),
                                                     (3, True, False), (3, False, False)])
def test_file_prompt_count_is_checked_when_the_file_is_read(tmp_path, rows, shuffle, ok):
    from unirl_core.config import load_recipe
    from unirl_core.runtime import build

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": i}) for i in range(rows)))
    cfg = load_recipe("tiny-grpo", ["data.source=file", f"data.file={{path: {path}, prompt_field: question, "
                                    f"shuffle: {str(shuffle).lower()}}}"])
    assert cfg.data.prompts_per_step == 4
    if ok:
        ds = build.dataset(cfg)
        assert len(ds) == rows
        assert all(len({r.prompt_id for r in ds.batch(s, 4)}) == 4 for s in range(20))
        return
    with pytest.raises(ConfigError) as info:
        build.dataset(cfg)
    assert str(info.value).startswith(f"data.prompts_per_step=4: expected at most the number of prompts "
                                      f"({rows} in data.file.path='{path}')")


def test_toy_task_prompts_and_reward():
    recs = toy_arithmetic_prompts(ToyArithmeticConfig(num_prompts=20, max_operand=9, seed=1))
    assert recs == toy_arithmetic_prompts(ToyArithmeticConfig(num_prompts=20, max_operand=9, seed=1))
    for r in recs:
        a, b = r.prompt.removesuffix(" =").split(" + ")
        assert int(r.targets["answer"]) == int(a) + int(b) and 0 <= int(a) <= 9
    assert toy_arithmetic_reward(" 12 ", "12") == 1.0
    assert toy_arithmetic_reward("13", "12") == 0.5
    assert toy_arithmetic_reward("1x", "12") == 0.25
    assert toy_arithmetic_reward("", "12") == 0.0 and toy_arithmetic_reward("ab", "1") == 0.0
    with pytest.raises(ConfigError):
        ToyArithmeticConfig(template="{a} plus")


def test_toy_scorer_through_the_reward_registry():
    from unirl_core.reward.scorers.base import ScoreItem, build_scorer

    scorer = build_scorer("toy_arithmetic")
    items = [ScoreItem(text="7", targets={"answer": "7"}), ScoreItem(text="x", targets={"answer": "7"}),
             ScoreItem(text=None, targets={"answer": "7"})]
    assert list(scorer(items)) == [1.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="answer"):
        scorer([ScoreItem(text="7")])
