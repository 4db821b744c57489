"""The sft workflow executed locally by flytekit, and the handoff of its export to the RL loop."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.sft.conftest import write_image_records, write_text_records
from unirl_core.checkpoint import CheckpointRef, CheckpointStore, load_weights
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local
from workflows.sft import sft

torch.set_num_threads(1)


def _overrides(root, name, data, steps=3, chunk=2):
    return [f"checkpoint.root={root}", f"name={name}", f"data.path={data}", f"loop.total_steps={steps}",
            f"loop.steps_per_chunk={chunk}"]


@pytest.mark.slow
def test_diffusion_sft_workflow_publishes_versions_the_rl_loop_starts_from(tmp_path, run_name):
    data = write_image_records(tmp_path / "data")
    out = sft(recipe="sft-tiny-sd3", overrides=_overrides(tmp_path, run_name, data))
    assert out.ckpt == CheckpointRef(uri=str(tmp_path / run_name / "step-00000003"), run=run_name, step=3,
                                     policy_version=3)
    store = CheckpointStore(str(tmp_path), run_name)
    assert [v.step for v in store.versions()] == [0, 2, 3]
    assert json.loads((tmp_path / run_name / "LATEST").read_text())["step"] == 3
    assert len((tmp_path / run_name / "sft_metrics.jsonl").read_text().splitlines()) == 3
    report = (tmp_path / run_name / "report" / "index.html").read_text()
    assert report.count("<img") == 8 and 'data-metric="sft/loss"' in report
    marker = json.loads((tmp_path / run_name / "export" / "export.json").read_text())
    assert marker["step"] == 3 and marker["max_sequence_length"] == 32

    # the RL loop starts from the export: its step-0 weights are the SFT version's
    rl = load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path / 'rl'}", "loop.total_steps=1",
                                        f"diffusion.model.source={out.export}", "diffusion.model.max_sequence_length=32",
                                        "data.samples_per_prompt=4", "diffusion.engine.forward_batch_size=4",
                                        "train.micro_batch_size=4", "diffusion.sampling.num_steps=4"])
    hist = run_local(rl, progress=False)
    assert len(hist) == 1 and hist[0]["train/ratio_mean"] == 1.0
    rl_start = load_weights(CheckpointStore(str(tmp_path / "rl"), rl.name).versions()[0])
    sft_end = load_weights(out.ckpt)
    assert rl_start and all(torch.equal(rl_start[k], sft_end[k]) for k in rl_start)


def test_lm_sft_workflow_exports_a_model_the_rl_loop_loads(tmp_path, run_name):
    data = write_text_records(tmp_path / "data")
    out = sft(recipe="sft-tiny-lm", overrides=_overrides(tmp_path, run_name, data, steps=2, chunk=2))
    assert out.ckpt.step == 2
    rl = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path / 'rl'}", "loop.total_steps=1",
                                   f"lm.model.model={out.export}", "data.prompts_per_step=2",
                                   "data.samples_per_prompt=4", "train.micro_batch_size=8",
                                   "lm.engine.forward_batch_size=8"])
    assert len(run_local(rl, progress=False)) == 1
    rl_start = load_weights(CheckpointStore(str(tmp_path / "rl"), rl.name).versions()[0])
    sft_end = load_weights(out.ckpt)
    assert rl_start and set(rl_start) <= set(sft_end)
    assert all(torch.equal(rl_start[k], sft_end[k]) for k in rl_start)


def test_bad_override_fails_in_setup_naming_the_field(tmp_path, run_name):
    with pytest.raises(Exception) as info:
        sft(recipe="sft-tiny-lm", overrides=_overrides(tmp_path, run_name, "x.jsonl") + ["train.micro_batch_size=3"])
    assert isinstance(info.value, ConfigError) or "train.micro_batch_size=3" in str(info.value)
    assert "train.micro_batch_size=3" in str(info.value) and "data.batch_size (8)" in str(info.value)
