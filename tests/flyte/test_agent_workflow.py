"""The grpo workflow with an agentic recipe, executed locally by flytekit: the typed tasks carry lm.agent, the
multi-turn batches and their turn structure, and the rollout deck shows the conversations."""

from __future__ import annotations

import json

import pytest

from tests.flyte.conftest import tiny_overrides
from unirl_core.checkpoint import CheckpointRef
from workflows.grpo import grpo

AGENT = ["lm.model.model=tiny", "data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
         "lm.engine.forward_batch_size=8", "eval.num_prompts=4", "eval.every_n_steps=2"]


@pytest.mark.slow
def test_tiny_agent_calc_end_to_end(tmp_path, run_name):
    overrides = [*AGENT, *tiny_overrides("tiny-grpo", str(tmp_path), run_name)[4:]]
    out = grpo(recipe="tiny-agent-calc", overrides=overrides)
    assert out == CheckpointRef(uri=str(tmp_path / run_name / "step-00000002"), run=run_name, step=2,
                                policy_version=2)
    run = tmp_path / run_name
    assert json.loads((run / "LATEST").read_text())["step"] == 2
    config = json.loads((run / "step-00000002" / "config.json").read_text())
    assert config["lm"]["agent"]["env"]["name"] == "calculator" and config["lm"]["agent"]["max_turns"] == 3
    steps = sorted(p for p in (run / "report").iterdir() if p.is_dir() and p.name.startswith("step"))
    assert len(steps) == 2
    metrics = json.loads((steps[-1] / "metrics.json").read_text())["metrics"]
    assert metrics["train/ratio_min"] == 1.0 == metrics["train/ratio_max"]
    assert "rollout/agent/model_turns_mean" in metrics and "reward/agent_return/mean" in metrics
    assert "eval/reward/agent_return/mean" in metrics
    rollout = (steps[-1] / "rollout.html").read_text()  # the rollout task's deck, copied into the report
    assert "conversations: 8 of 8 trajectories" in rollout and "class='turn-model'" in rollout
