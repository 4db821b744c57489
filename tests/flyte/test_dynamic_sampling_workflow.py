"""The grpo workflow with DAPO dynamic sampling (``filter_groups``) and the overlong penalty, run locally by
flytekit (batches cross the task boundaries as Arrow files)."""

from __future__ import annotations

import json

import pytest

from tests.flyte.conftest import tiny_overrides
from workflows.grpo import grpo


@pytest.mark.slow
def test_filter_groups_runs_between_reward_and_advantage(tmp_path, run_name):
    over = tiny_overrides("tiny-grpo", str(tmp_path), run_name) + [
        "filter_groups={max_num_gen_batches: 3}", "train.old_logp_source=replay",
        "lm.algorithm.overlong_buffer_len=2", "lm.algorithm.overlong_penalty_factor=0.5"]
    out = grpo(recipe="tiny-grpo", overrides=over)
    assert out.step == 2
    for step in (1, 2):
        rec = json.loads((tmp_path / run_name / "report" / f"step-{step:08d}" / "metrics.json").read_text())
        m = rec["metrics"]
        assert 1.0 <= m["filter_groups/rounds"] <= 3.0 and "reward/mean" in m and "time/dynamic_sampling" in m
        assert m["filter_groups/kept_first_round"] + m["filter_groups/refilled_groups"] \
            + m["filter_groups/padded_groups"] == 2.0  # the step's 2 groups, whatever the rounds
        assert m["train/ratio_mean"] == 1.0  # pi_old replayed over the refilled batch
        assert m["advantage/num_samples"] == 8.0
        assert -0.5 <= m["reward/overlong_penalty_mean"] <= 0.0 and "reward/overlong_frac" in m
        csv = (tmp_path / run_name / "report" / f"step-{step:08d}" / "rewards.csv").read_text()
        assert "overlong" in csv.splitlines()[0]  # the penalty travels as a reward component
