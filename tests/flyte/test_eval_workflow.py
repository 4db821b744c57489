"""The eval phase in Flyte: eval_task after the publish of due steps (its eval/* metrics in the run report), and
the standalone evaluate workflow on a published version (same deterministic numbers)."""

from __future__ import annotations

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.flyte.conftest import tiny_overrides
from workflows.evaluate import evaluate
from workflows.grpo import grpo

EVAL = ['eval.prompts=["a red fox", "a blue lake"]', "eval.every_n_steps=1"]


@pytest.mark.slow
def test_grpo_evaluates_each_due_step_and_evaluate_reproduces_it(tmp_path, run_name):
    overrides = tiny_overrides("tiny-flow-grpo", str(tmp_path), run_name) + EVAL
    grpo(recipe="tiny-flow-grpo", overrides=overrides)
    steps = json.loads((tmp_path / run_name / "report" / "steps.json").read_text())
    records = steps if isinstance(steps, list) else steps["steps"]
    evals = [r["metrics"]["eval/reward/mean"] for r in records]
    assert len(evals) == 2
    index = (tmp_path / run_name / "report" / "index.html").read_text()
    assert 'data-metric="eval/reward/mean"' in index
    assert "held-out evaluation: step 0 vs step 2" in index  # the start eval's record, next to the last one
    # the eval chart holds the starting policy too (steps 0, 1, 2), and so does TensorBoard
    chart = re.search(r'<svg class="curve" data-metric="eval/reward/mean".*?</svg>', index, flags=re.S).group(0)
    assert chart.split('<g id="series_0">')[1].split('<g id="')[0].count("<use ") == 3  # markers at steps 0, 1, 2
    tb = EventAccumulator(str(tmp_path / run_name / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("eval/reward/mean")] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / run_name / "report" / "eval").glob("*[0-9].json")) == [
        "step-00000000.json", "step-00000001.json", "step-00000002.json"]
    out = evaluate(recipe="tiny-flow-grpo", overrides=overrides, version="latest", weights="")
    assert out["eval/step"] == 2.0 and out["eval/reward/mean"] == pytest.approx(evals[-1], abs=0.0)
    first = evaluate(recipe="tiny-flow-grpo", overrides=overrides, version=str(tmp_path / run_name / "step-00000001"),
                     weights="policy")
    assert first["eval/step"] == 1.0 and first["eval/reward/mean"] == pytest.approx(evals[0], abs=0.0)


def test_eval_task_is_wired_after_publish_of_due_steps_only():
    from tests.flyte.test_dynamic_compile import _compile, _targets

    spec = _compile(["loop.total_steps=5", "loop.steps_per_chunk=3", "eval.every_n_steps=2",
                     "eval.num_prompts=2"])
    names = [t.rsplit(".", 1)[1] for t in _targets(spec)]
    step = ["rollout_one_task", "reward_task", "advantage_task", "train_task", "publish_task"]
    # the starting version first (the report's held-out "before"), then every due step
    assert names == ["eval_task", *step, "report_task", *step, "eval_task", "report_task", *step, "report_task",
                     "grpo_chunk"]
    by_id = {n.id: n for n in spec.nodes}
    ev = next(n for n in spec.nodes if n.task_node and n.task_node.reference_id.name.endswith("eval_task"))
    report = next(n for n in spec.nodes if ev.id in n.upstream_node_ids)
    assert report.task_node.reference_id.name.endswith("report_task") and report.id in by_id
    task = next(t for t in spec.tasks if t.id.name.endswith("eval_task"))
    assert task.container.resources.requests  # samples and scores on a GPU pod
