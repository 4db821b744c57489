"""The grpo workflow with async_training.max_policy_lag=1, executed locally by flytekit: the chunked DAG (a rollout
sampling a version published before its chunk comes from lagged_version_task) reproduces run_local's numbers."""

from __future__ import annotations

import json

import pytest
import torch

from tests.flyte.conftest import tiny_overrides
from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local
from workflows.grpo import grpo

torch.set_num_threads(1)

LAG = ["async_training.max_policy_lag=1", "train.old_logp_source=replay", "lm.algorithm.tis_cap=2.0"]


@pytest.mark.slow
def test_lag_one_workflow_matches_run_local(tmp_path, run_name):
    ov = tiny_overrides("tiny-grpo", str(tmp_path), run_name, steps=4, chunk=2) + LAG
    out = grpo(recipe="tiny-grpo", overrides=ov)
    assert out.step == 4
    report = tmp_path / run_name / "report"
    flyte = [json.loads((report / f"step-{s:08d}" / "metrics.json").read_text())["metrics"] for s in range(1, 5)]
    local = run_local(load_recipe("tiny-grpo", tiny_overrides("tiny-grpo", str(tmp_path), f"{run_name}-local",
                                                              steps=4) + LAG + ["report.tensorboard=false"]),
                      progress=False)
    # step 3 opens the second chunk and samples version 1, read back from the store
    assert [m["train/staleness_max"] for m in flyte] == [0.0, 1.0, 1.0, 1.0]
    for key in ("reward/mean", "train/loss", "train/is_weight_mean"):
        assert [m[key] for m in flyte] == [h[key] for h in local], key


def test_partial_rollouts_are_refused_by_the_workflow(tmp_path, run_name):
    ov = tiny_overrides("tiny-grpo", str(tmp_path), run_name) + LAG + [
        "async_training.partial_rollout={interrupt_at_tokens: 2}"]
    with pytest.raises(Exception, match="async_training.partial_rollout"):
        grpo(recipe="tiny-grpo", overrides=ov)
    assert not (tmp_path / run_name).exists()  # refused at setup, before any version is written
