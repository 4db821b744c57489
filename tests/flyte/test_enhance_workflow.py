"""The enhance workflow executed locally by flytekit: both stacks train and publish, the report shows the
enhanced prompt and the image of every sample."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.compose.conftest import small_overrides
from unirl_core.checkpoint import CheckpointRef, CheckpointStore
from workflows.enhance import enhance

torch.set_num_threads(1)


@pytest.mark.slow
def test_enhance_workflow_trains_and_publishes_both_stacks(tmp_path, run_name):
    overrides = small_overrides(tmp_path, "loop.steps_per_chunk=1", "eval={every_n_steps: 2, images_per_prompt: 1}",
                                name=run_name)
    out = enhance(recipe="shapes-enhance", overrides=overrides)
    for stack in ("enhancer", "image"):
        ref = getattr(out, stack)
        assert ref == CheckpointRef(uri=str(tmp_path / run_name / stack / "step-00000002"), run=stack, step=2,
                                    policy_version=2)
        assert CheckpointStore(str(tmp_path / run_name), stack).latest().step == 2
    report = tmp_path / run_name / "report"
    lines = [{**r["metrics"], "step": r["step"]} for r in json.loads((report / "steps.json").read_text())]
    assert [h["step"] for h in lines] == [1, 2]
    assert lines[0]["enhancer/train/ratio_mean"] == 1.0 and lines[0]["image/train/ratio_mean"] == 1.0
    assert "eval/reward/mean" in lines[1] and "eval/reward/mean" not in lines[0]
    page = (report / "step-00000002" / "samples.html").read_text()
    assert "enhanced prompt" in page and page.count("<img") == 8 and "greedy enhancement" in page
    assert 'data-metric="reward/mean"' in (report / "index.html").read_text()

