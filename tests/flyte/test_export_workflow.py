"""Export through Flyte (``workflows/export.py``, flytekit local execution): a trained LoRA run's latest version
becomes a peft adapter that ``PeftModel.from_pretrained`` loads with the version's adapter weights, a version folder
exports as a diffusers pipeline, and a wrong format fails naming the field; the task is a CPU pod on the train
image."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.export import export_task
from unirl_core.config.recipes import load_recipe
from unirl_core.loop.local import run_local
from unirl_core.models.lora import lora_state_dict
from unirl_core.runtime.build import fresh_bundle, load_policy_weights
from unirl_core.runs.export import version_ref
from workflows.export import export

SMALL = ["data.prompts_per_step=1", "data.samples_per_prompt=2", "diffusion.sampling.num_steps=2",
         "train.micro_batch_size=2", "diffusion.engine.forward_batch_size=2", "diffusion.model.finetune=lora",
         "diffusion.model.lora.rank=4", "loop.total_steps=1", "loop.steps_per_chunk=1", "report.progress=false"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-wf")
    cfg = load_recipe("tiny-flow-grpo", ["name=exp-wf", f"checkpoint.root={root}", *SMALL])
    run_local(cfg, progress=False)
    return cfg, root / cfg.name


@pytest.mark.slow
def test_export_workflow_writes_a_peft_adapter_that_loads_with_the_versions_weights(lora_run, tmp_path):
    from peft import PeftModel

    from unirl_core.models.diffusion_tiny import tiny_sd3_pipeline

    cfg, run = lora_run
    out = export(source=str(run), out=str(tmp_path / "peft"))  # "" picks the run's default format: peft
    assert out == str(tmp_path / "peft")
    ref = version_ref(str(run))
    marker = json.loads((tmp_path / "peft" / "export.json").read_text())
    assert marker["format"] == "peft" and marker["version_uri"] == ref.uri and marker["step"] == 1
    bundle = fresh_bundle(cfg)
    load_policy_weights(bundle, ref, cfg)
    peft_model = PeftModel.from_pretrained(tiny_sd3_pipeline(seed=cfg.diffusion.model.seed).transformer, out)
    got = {k.replace("base_model.model.", "").replace(".default", ""): v
           for k, v in peft_model.state_dict().items() if "lora_" in k}
    own = lora_state_dict(bundle.module)
    assert got.keys() == own.keys() and all(torch.equal(got[k], own[k]) for k in own)


@pytest.mark.slow
def test_export_workflow_takes_a_version_folder_and_a_format(lora_run, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    _, run = lora_run
    version = run / "step-00000000"
    export(source=str(version), out=str(tmp_path / "pipe"), fmt="diffusers")
    assert json.loads((tmp_path / "pipe" / "export.json").read_text())["step"] == 0
    StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "pipe"))
    with pytest.raises(Exception, match="an LM run"):
        export(source=str(run), out=str(tmp_path / "tf"), fmt="transformers")
    with pytest.raises(Exception, match=r"export format='onnx'"):
        export(source=str(run), out=str(tmp_path / "x"), fmt="onnx")


def test_export_task_is_a_cpu_pod_on_the_train_image():
    from images import train_image

    assert export_task.container_image is train_image
    assert export_task.resources.requests.gpu is None and export_task.resources.requests.mem == "32Gi"
