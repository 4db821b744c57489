"""Prompt data sets: jsonl / parquet / HF datasets dir, deterministic per-step shuffling, toy task."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from unirl_core.data import (PromptDataConfig, PromptDataset, ToyArithmeticConfig, load_prompts,
                             toy_arithmetic_prompts, toy_arithmetic_reward)
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
