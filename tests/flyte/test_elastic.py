"""The recipe's cluster section picks the PyTorch-Elastic train task; locally it runs 2 gloo workers."""

from __future__ import annotations

import json

import pytest

from tests.flyte.conftest import tiny_overrides
from workflows.grpo import grpo


@pytest.mark.slow  # torch elastic spawns 2 fresh interpreters per step (~30 s on 2 busy cores)
def test_two_process_elastic_train_step(tmp_path, run_name):
    ov = tiny_overrides("tiny-grpo", str(tmp_path), run_name, steps=1) + ["cluster.train_nproc_per_node=2"]
    out = grpo(recipe="tiny-grpo", overrides=ov)
    assert out.step == 1
    manifest = json.loads((tmp_path / run_name / "step-00000001" / "manifest.json").read_text())
    assert manifest["meta"]["world_size"] == "2"  # written by rank 0 of a 2-process FSDP job
    metrics = json.loads((tmp_path / run_name / "report/step-00000001/metrics.json").read_text())["metrics"]
    assert metrics["train/ratio_mean"] == 1.0 and metrics["train/num_samples"] == 8.0
