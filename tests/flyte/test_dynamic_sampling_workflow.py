"""The grpo workflow with DAPO dynamic sampling (``filter_groups``), executed locally by flytekit."""

from __future__ import annotations

import json

from tests.flyte.conftest import tiny_overrides
from workflows.grpo import grpo


def test_filter_groups_runs_between_reward_and_advantage(tmp_path, run_name):
    over = tiny_overrides("tiny-grpo", str(tmp_path), run_name) + [
        "filter_groups={max_num_gen_batches: 3}", "train.old_logp_source=replay"]
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
