"""Forks (``checkpoint.fork_from: <run>@<step>``) on short tiny-grpo runs: the prefix is not run again, the fork's
state entering step k+1 is the parent's version k bit for bit, a changed reward diverges, storage is shared by
reference (never copied, never deleted by the fork), forks of forks, and one clear error per bad input."""

from __future__ import annotations

import json

import pytest
import torch

from unirl_core.checkpoint import CheckpointStore, load_checkpoint
from unirl_core.config import load_recipe
from unirl_core.errors import CheckpointError, ConfigError
from unirl_core.io.diff import same_bits
from unirl_core.loop import local
from unirl_core.loop.local import run_local
from unirl_core.loop.phases import init_run

PARENT = "tiny-grpo"
SMALL = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
         "lm.engine.forward_batch_size=8", "checkpoint.keep_every=1"]
OTHER_REWARD = 'reward.components=[{"name": "toy_arithmetic", "weight": -1.0}]'  # flips every advantage


def _cfg(root, steps: int, *extra: str):
    return load_recipe(PARENT, [*SMALL, f"checkpoint.root={root}", f"loop.total_steps={steps}", *extra])


def _fork(root, name: str, at: str, steps: int, *extra: str):
    return _cfg(root, steps, f"name={name}", f"checkpoint.fork_from={at}", *extra)


def _version(root, run: str, step: int):
    return load_checkpoint(CheckpointStore(str(root), run).ref_for(step, step))


def _bitwise_equal(a, b) -> bool:
    """Nested state (dicts, lists) equal leaf by leaf, tensors and floats by their bits."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b))
    return same_bits(a, b)


@pytest.fixture
def phase_steps(monkeypatch):
    """The reward phase's calls and the steps the train phase ran for (the test's counter of executed work)."""
    seen: dict[str, list[int]] = {"reward": [], "train": []}
    reward, train = local.reward_phase, local.train_phase

    def counted_reward(cfg, batch, *a, **kw):
        seen["reward"].append(len(batch))
        return reward(cfg, batch, *a, **kw)

    def counted_train(cfg, batch, ckpt, *a, step, **kw):
        seen["train"].append(step)
        return train(cfg, batch, ckpt, *a, step=step, **kw)

    monkeypatch.setattr(local, "reward_phase", counted_reward)
    monkeypatch.setattr(local, "train_phase", counted_train)
    return seen


def test_fork_without_overrides_continues_the_parent_bit_for_bit(tmp_path, phase_steps):
    run_local(_cfg(tmp_path, 4))
    assert phase_steps["train"] == [1, 2, 3, 4]
    phase_steps["train"].clear(), phase_steps["reward"].clear()

    hist = run_local(_fork(tmp_path, "fork-a", f"{PARENT}@2", 4))
    assert [h["step"] for h in hist] == [3.0, 4.0]  # steps 1-2 are not run again
    assert phase_steps["train"] == [3, 4] and len(phase_steps["reward"]) == 2
    start = _version(tmp_path, "fork-a", 2)  # the state entering step 3: the parent's version 2
    parent2 = _version(tmp_path, PARENT, 2)
    for field in ("weights", "ema_weights", "train_state"):
        assert _bitwise_equal(getattr(start, field), getattr(parent2, field)), field
    for step in (3, 4):  # and what the fork trains from it: the parent's versions, bit for bit
        a, b = _version(tmp_path, PARENT, step), _version(tmp_path, "fork-a", step)
        for field in ("weights", "ema_weights", "train_state"):
            assert _bitwise_equal(getattr(a, field), getattr(b, field)), (step, field)
    lineage = json.loads((tmp_path / "fork-a" / "step-00000004" / "extra.json").read_text())["lineage"]
    assert (lineage["parent_run"], lineage["parent_step"], lineage["changes"]) == (PARENT, 2, {})


def test_fork_with_another_reward_diverges_and_records_it(tmp_path, phase_steps):
    run_local(_cfg(tmp_path, 4))
    phase_steps["train"].clear()
    hist = run_local(_fork(tmp_path, "fork-r", f"{PARENT}@2", 4, OTHER_REWARD))
    assert phase_steps["train"] == [3, 4] and [h["step"] for h in hist] == [3.0, 4.0]
    # step 3's rewards are all 0 on this seed (no advantage either way); step 4's are not: there it diverges
    a, b = _version(tmp_path, PARENT, 4), _version(tmp_path, "fork-r", 4)
    assert hist[1]["reward/mean"] < 0 and not _bitwise_equal(a.weights, b.weights)
    assert _bitwise_equal(_version(tmp_path, PARENT, 2).weights, _version(tmp_path, "fork-r", 2).weights)
    lineage = b.extra["lineage"]
    assert lineage["parent_uri"] == str(tmp_path / PARENT / "step-00000002")
    assert list(lineage["changes"]) == ["reward.components"]
    assert b.config["reward"]["components"][0]["weight"] == -1.0
    assert b.config["checkpoint"]["fork_from"] == f"{PARENT}@2"


def test_forks_share_the_parents_files_and_retention_keeps_them(tmp_path):
    run_local(_cfg(tmp_path, 3))
    parent = tmp_path / PARENT
    run_local(_fork(tmp_path, "fork-a", f"{PARENT}@2", 3))
    run_local(_fork(tmp_path, "fork-b", f"{PARENT}@2", 3, "train.lr=1e-3"))
    for fork in ("fork-a", "fork-b"):
        start = tmp_path / fork / "step-00000002"
        # the start version holds only its own config, lineage and manifest; the big files are the parent's
        assert sorted(p.name for p in start.iterdir()) == ["config.json", "extra.json", "manifest.json"]
        files = json.loads((start / "manifest.json").read_text())["files"]
        assert {files[n]["run"] for n in ("model.safetensors", "train_state.pt")} == {PARENT}
        assert json.loads((parent / "forks" / f"{fork}.json").read_text())["step"] == 2
    # forks of forks: of a fork's own version (its files), and of a fork's start version (the parent's files)
    run_local(_fork(tmp_path, "fork-aa", "fork-a@3", 4))
    run_local(_fork(tmp_path, "fork-a2", "fork-a@2", 3))
    assert json.loads((tmp_path / "fork-aa" / "step-00000003" / "manifest.json").read_text())[
        "files"]["model.safetensors"]["run"] == "fork-a"
    assert json.loads((tmp_path / "fork-a2" / "step-00000002" / "manifest.json").read_text())[
        "files"]["model.safetensors"]["run"] == PARENT
    aa = _version(tmp_path, "fork-aa", 4).extra["lineage"]
    assert aa["parent_run"] == "fork-a" and aa["parent_lineage"]["parent_run"] == PARENT

    # the fork's retention removes its own start version, never the parent's files
    run_local(_fork(tmp_path, "fork-b", f"{PARENT}@2", 6, "train.lr=1e-3", "checkpoint.keep_every=null",
                    "checkpoint.keep_last=1"))
    assert not (tmp_path / "fork-b" / "step-00000002").exists()
    assert (parent / "step-00000002" / "model.safetensors").is_file()
    # a fork's start version that a fork of it names as parent stays (pinned; a manifest, no weights)
    run_local(_fork(tmp_path, "fork-a", f"{PARENT}@2", 6, "checkpoint.keep_every=null", "checkpoint.keep_last=1"))
    assert [r.step for r in CheckpointStore(str(tmp_path), "fork-a").versions()] == [2, 3, 6]
    # the parent's own retention keeps the version forks reference
    run_local(_cfg(tmp_path, 5, "checkpoint.keep_every=null", "checkpoint.keep_last=1"))
    assert [r.step for r in CheckpointStore(str(tmp_path), PARENT).versions()] == [2, 5]
    assert _bitwise_equal(_version(tmp_path, "fork-a", 2).weights, _version(tmp_path, PARENT, 2).weights)


def test_bad_fork_points_name_the_field_value_and_fix(tmp_path):
    run_local(_cfg(tmp_path, 2, "checkpoint.keep_every=null", "checkpoint.every_n_steps=2", "checkpoint.keep_last=9"))
    with pytest.raises(CheckpointError, match=r"^checkpoint.fork_from='nope@1'.*holds none; name one of the runs "
                                              r"there \(\['tiny-grpo'\]\)"):
        init_run(_fork(tmp_path, "f", "nope@1", 3))
    with pytest.raises(CheckpointError, match=r"^checkpoint.fork_from='tiny-grpo@7'.*one of \[0, 1, 2\]"):
        init_run(_fork(tmp_path, "f", f"{PARENT}@7", 3))
    with pytest.raises(CheckpointError, match=r"^checkpoint.fork_from='tiny-grpo@1'.*holds weights only.*fork one "
                                              r"of steps \[0, 2\]"):
        init_run(_fork(tmp_path, "f", f"{PARENT}@1", 3))
    with pytest.raises(ConfigError, match=r"^checkpoint.fork_from='tiny-grpo@2'.*name=tiny-grpo-b"):
        init_run(_cfg(tmp_path, 3, f"checkpoint.fork_from={PARENT}@2"))
    with pytest.raises(ConfigError, match=r"^checkpoint.fork_from='tiny-grpo:2'.*'<run>@<step>'"):
        _fork(tmp_path, "f", "tiny-grpo:2", 3)
    with pytest.raises(ConfigError, match=r"^lm.model.tiny.num_layers=1.*new run from scratch"):
        init_run(_fork(tmp_path, "f", f"{PARENT}@2", 3, "lm.model.tiny.num_layers=1"))
    assert not (tmp_path / "f").exists() and not (tmp_path / PARENT / "forks").exists()


def test_a_forks_first_step_replays_from_its_start_version(tmp_path):
    from unirl_core.runs.replay import replay

    run_local(_cfg(tmp_path, 2))
    run_local(_fork(tmp_path, "fork-k", f"{PARENT}@1", 2, "checkpoint.keep_batches=true", "train.lr=1e-3"))
    report = replay(str(tmp_path / "fork-k"), step=2)  # from version 1: the parent's files, through the reference
    assert report.step == 2 and report.samples == 8


def test_fork_from_is_refused_where_no_fork_starts(tmp_path):
    from unirl_core.compose.config import load_compose_recipe
    from unirl_core.sft.config import load_sft_recipe

    for load, recipe in ((load_compose_recipe, "shapes-enhance"), (load_sft_recipe, "sft-shapes")):
        with pytest.raises(ConfigError, match=r"^checkpoint.fork_from='x@1'.*forks start RL runs"):
            load(recipe, ["checkpoint.fork_from=x@1"])


def test_fork_from_into_an_existing_other_run_names_the_fields_the_user_set(tmp_path):
    # review finding: with checkpoint.fork_from (no fork_as given) the refusal named fork_as
    run_local(_cfg(tmp_path, 1))
    run_local(_cfg(tmp_path, 1, "name=other"))
    with pytest.raises(ConfigError, match=r"^name='other'.*not a fork of .*checkpoint.fork_from"):
        init_run(_fork(tmp_path, "other", f"{PARENT}@1", 3))
