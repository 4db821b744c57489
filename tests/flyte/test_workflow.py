"""The grpo workflow executed locally by flytekit: both tiny recipes, resume after a crash, the cache."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.flyte.conftest import tiny_overrides
from unirl_core.checkpoint import CheckpointRef, load_weights
from unirl_core.loop import phases
from workflows.grpo import grpo


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def progress_lines():
    h = _Lines()
    log = logging.getLogger("unirl.progress")
    log.addHandler(h)
    yield h.lines
    log.removeHandler(h)


def _count_calls(monkeypatch, *names: str) -> dict[str, int]:
    calls = dict.fromkeys(names, 0)
    for name in names:
        orig = getattr(phases, name)

        def wrapped(*a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(*a, **k)
        monkeypatch.setattr(phases, name, wrapped)
    return calls


@pytest.mark.parametrize("recipe, extra", [("tiny-flow-grpo", ["loop.rollout_shards=2"]), ("tiny-grpo", [])])
@pytest.mark.slow
def test_tiny_recipe_end_to_end(tmp_path, run_name, progress_lines, recipe, extra):
    out = grpo(recipe=recipe, overrides=tiny_overrides(recipe, str(tmp_path), run_name) + extra)
    assert out == CheckpointRef(uri=str(tmp_path / run_name / "step-00000002"), run=run_name, step=2,
                                policy_version=2)
    run = tmp_path / run_name
    assert json.loads((run / "LATEST").read_text())["step"] == 2
    steps = [ln for ln in progress_lines if ln.startswith("step ")]
    assert [ln.split(" |")[0] for ln in steps] == ["step 1/2", "step 2/2"]
    assert all("reward" in ln and "ratio 1.0000" in ln and "ETA" in ln for ln in steps)
    assert progress_lines[-1].startswith(f"run {run_name!r} reached step 2 of 2:")  # and where it wrote what
    report = run / "report"
    index = (report / "index.html").read_text()
    assert index.count("class='step-row'") == 2 and 'data-metric="reward/mean"' in index  # the reward chart
    for step in (1, 2):
        folder = report / f"step-{step:08d}"
        rec = json.loads((folder / "metrics.json").read_text())
        m = rec["metrics"]
        assert {"reward/mean", "train/loss", "train/ratio_mean", "time/rollout", "time/train"} <= set(m)
        assert m["rollout/samples"] == 8.0  # 2 prompts x 4 samples, summed over the shards
        assert sorted(rec["pages"]) == ["advantage", "publish", "reward", "rollout", "train"]
        assert len((folder / "rewards.csv").read_text().splitlines()) == 9
        grid = (folder / "grid.html").read_text()
        assert ("<img" in grid) == (recipe == "tiny-flow-grpo")
    assert json.loads((report / "config.json").read_text())["name"] == run_name
    acc = EventAccumulator(str(run / "tensorboard"))  # the report task's TensorBoard scalars, one file per step
    acc.Reload()
    for key in ("reward/mean", "train/loss"):
        assert [(e.step, e.value) for e in acc.Scalars(key)] == [
            (s, pytest.approx(json.loads((report / f"step-{s:08d}" / "metrics.json").read_text())["metrics"][key]))
            for s in (1, 2)]


@pytest.mark.slow
def test_interrupted_run_resumes_with_nothing_lost(tmp_path, run_name, monkeypatch):
    recipe = "tiny-grpo"
    ov = tiny_overrides(recipe, str(tmp_path), run_name, steps=4, chunk=2)
    publish = phases.publish_phase

    def crash_at_3(cfg, ckpt):
        if ckpt.step == 3:  # train already wrote step 3 (unpublished); the crash leaves it behind
            raise RuntimeError("simulated node loss")
        return publish(cfg, ckpt)

    monkeypatch.setattr(phases, "publish_phase", crash_at_3)
    with pytest.raises(Exception, match="simulated node loss"):
        grpo(recipe=recipe, overrides=ov)
    run = tmp_path / run_name
    assert json.loads((run / "LATEST").read_text())["step"] == 2 and (run / "step-00000003").is_dir()
    before = {s: json.loads((run / f"report/step-{s:08d}/metrics.json").read_text()) for s in (1, 2)}

    monkeypatch.setattr(phases, "publish_phase", publish)
    calls = _count_calls(monkeypatch, "rollout_phase", "train_phase")
    resumed = grpo(recipe=recipe, overrides=ov)  # resume="latest"
    # steps 1-2 are not redone; step 3's rollout finished before the crash and comes from the cache
    assert resumed.step == 4 and calls == {"rollout_phase": 1, "train_phase": 2}
    for s in (1, 2):  # the records of the steps done before the crash are untouched
        assert json.loads((run / f"report/step-{s:08d}/metrics.json").read_text()) == before[s]
    assert sorted(p.name for p in (run / "report").glob("step-*")) == [f"step-{s:08d}" for s in (1, 2, 3, 4)]

    # the same run without the crash ends in bit-identical weights
    other = f"{run_name}-ref"
    ref = grpo(recipe=recipe, overrides=tiny_overrides(recipe, str(tmp_path), other, steps=4, chunk=2))
    a, b = load_weights(resumed), load_weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_unchanged_step_hits_the_cache(tmp_path, run_name, monkeypatch):
    recipe = "tiny-grpo"
    ov = tiny_overrides(recipe, str(tmp_path), run_name, steps=1)
    publish = phases.publish_phase

    def crash(cfg, ckpt):
        raise RuntimeError("simulated crash before publish")

    monkeypatch.setattr(phases, "publish_phase", crash)
    with pytest.raises(Exception, match="simulated crash"):
        grpo(recipe=recipe, overrides=ov)  # step 1 trained and left unpublished; step 0 stays the published one
    calls = _count_calls(monkeypatch, "rollout_phase", "reward_phase", "advantage_phase", "train_phase")
    step0 = str(Path(tmp_path) / run_name / "step-00000000")
    with pytest.raises(Exception, match="simulated crash"):
        grpo(recipe=recipe, overrides=[*ov, "loop.seed=1"], resume=step0)  # a changed config misses
    assert calls["rollout_phase"] == 1
    monkeypatch.setattr(phases, "publish_phase", publish)
    again = grpo(recipe=recipe, overrides=ov, resume=step0)  # re-run step 1 from the same version
    assert again.step == 1
    # rollout, reward and advantage come from the cache; train and publish (side effects) always run
    assert calls == {"rollout_phase": 1, "reward_phase": 1, "advantage_phase": 1, "train_phase": 2}


@pytest.mark.slow
def test_fork_from_an_older_version_leaves_the_run_untouched(tmp_path, run_name):
    recipe = "tiny-grpo"
    ov = tiny_overrides(recipe, str(tmp_path), run_name, steps=2)
    grpo(recipe=recipe, overrides=ov)
    run = tmp_path / run_name
    step1 = str(run / "step-00000001")
    with pytest.raises(Exception, match=r"already has steps \[2\] after step 1.*fork_as"):
        grpo(recipe=recipe, overrides=ov, resume=step1)
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    fork = f"{run_name}-b"
    out = grpo(recipe=recipe, overrides=[*ov, "train.lr=1e-3"], resume=step1, fork_as=fork)
    assert (out.run, out.step) == (fork, 2) and out.uri == str(tmp_path / fork / "step-00000002")
    after = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    pin = run / "forks" / f"{fork}.json"  # the pin that keeps the version the fork references; nothing else changed
    assert after.pop(pin) and after == before
    lineage = json.loads((tmp_path / fork / "step-00000002" / "extra.json").read_text())["lineage"]
    assert (lineage["parent_run"], lineage["parent_step"], lineage["parent_uri"]) == (run_name, 1, step1)
    assert lineage["changes"] == {"train.lr": [0.002, 0.001]}
    report = tmp_path / fork / "report"
    assert json.loads((report / "config.json").read_text())["name"] == fork
    assert (report / "step-00000002" / "metrics.json").is_file()


@pytest.mark.slow
def test_finished_run_says_how_to_extend_it(tmp_path, run_name, caplog):
    ov = tiny_overrides("tiny-grpo", str(tmp_path), run_name, steps=1)
    grpo(recipe="tiny-grpo", overrides=ov)
    with caplog.at_level(logging.WARNING):
        assert grpo(recipe="tiny-grpo", overrides=ov).step == 1
    assert "already complete" in caplog.text and '"loop.total_steps=2"' in caplog.text


@pytest.mark.slow
def test_max_steps_bounds_one_execution_and_the_next_resumes(tmp_path, run_name):
    # what a scheduled LaunchPlan does: resume="latest" plus a per-execution budget
    ov = tiny_overrides("tiny-grpo", str(tmp_path), run_name, steps=3, chunk=1)
    assert grpo(recipe="tiny-grpo", overrides=ov, max_steps=2).step == 2
    assert grpo(recipe="tiny-grpo", overrides=ov, max_steps=2).step == 3  # only one step left
    assert grpo(recipe="tiny-grpo", overrides=ov, max_steps=2).step == 3  # the run is complete: nothing to do


@pytest.mark.slow
def test_a_long_local_run_is_not_cut_by_nested_sandbox_folders(tmp_path, run_name):
    # 40 chunks of one step: flytekit's local runner names each chunk's sandbox after the previous one's plus 8
    # characters, which passed the 255-character file-name limit at chunk ~29 (OSError: File name too long) before
    # a local execution merged chunks (tasks.common.chunk_steps: at most LOCAL_MAX_CHUNKS chained chunks)
    ov = tiny_overrides("tiny-grpo", str(tmp_path), run_name, steps=40, chunk=1)
    assert grpo(recipe="tiny-grpo", overrides=ov).step == 40
