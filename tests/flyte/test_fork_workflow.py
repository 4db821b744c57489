"""A fork through the grpo workflow (flytekit local execution): ``checkpoint.fork_from`` as an override starts the
fork at the parent's version, so no task of the prefix runs, and without other overrides the fork's versions are
the parent's, bit for bit."""

from __future__ import annotations

import json

import pytest

from tests.flyte.conftest import tiny_overrides
from tests.flyte.test_workflow import _count_calls
from unirl_core.checkpoint import CheckpointStore, load_checkpoint
from unirl_core.io.diff import same_bits
from workflows.grpo import grpo


@pytest.mark.slow
def test_fork_from_runs_only_the_steps_after_the_fork_point(tmp_path, run_name, monkeypatch):
    recipe = "tiny-grpo"
    grpo(recipe=recipe, overrides=[*tiny_overrides(recipe, str(tmp_path), run_name, steps=4, chunk=2),
                                   "checkpoint.keep_every=1"])
    calls = _count_calls(monkeypatch, "rollout_phase", "reward_phase", "train_phase")
    fork = f"{run_name}-f"
    out = grpo(recipe=recipe, overrides=[*tiny_overrides(recipe, str(tmp_path), fork, steps=4, chunk=2),
                                         "checkpoint.keep_every=1", f"checkpoint.fork_from={run_name}@2"])
    assert (out.run, out.step) == (fork, 4)
    assert calls == {"rollout_phase": 2, "reward_phase": 2, "train_phase": 2}  # steps 3 and 4 only
    start = json.loads((tmp_path / fork / "step-00000002" / "manifest.json").read_text())
    assert start["files"]["model.safetensors"]["run"] == run_name  # referenced, not copied
    assert sorted(p.name for p in (tmp_path / fork / "report").glob("step-*")) == ["step-00000003", "step-00000004"]
    for step in (2, 3, 4):
        a, b = (load_checkpoint(CheckpointStore(str(tmp_path), r).ref_for(step, step)) for r in (run_name, fork))
        assert same_bits(a.weights, b.weights) and same_bits(a.train_state, b.train_state), step
    assert load_checkpoint(out).extra["lineage"]["parent_step"] == 2
