"""The CPU rehearsal of each cluster recipe (``unirl_core/config/rehearsal.py``): the recipe file as shipped, plus the
rehearsal's overrides (its models at random init and tiny shapes, a local storage root), runs 2 steps through
``pyflyte run workflows/grpo.py grpo`` (a local execution: every task of the pods workflow in this process) with its
real prompt file, its real reward code (PickScore's CLIP code on a random-init tiny CLIP, rapidocr, math-verify),
its metrics, the run report and TensorBoard; then the last version is exported with the documented command and the
export loads back with ``from_pretrained``, weights equal to the version's.

Each recipe runs with the pods workflow's phase tasks in this process (``slow`` tier, 27-44 s each on the loaded
2-core box); ``sd35m-pickscore`` and ``qwen3-math`` (one run of each family) also in pool mode (``pool.execution=pool``:
the same tasks as clients of a Ray pool that pyflyte's process starts on a local head, its actors at half a CPU each;
``integration`` tier, 49-73 s each). ``sd35m-ocr`` in the pool would add only its scorer, which pods mode runs: CI's
time budget leaves it out.

What only the GPU rehearsal can show (docs/cluster.md): the real weights' download, bf16 numerics, CUDA graphs,
memory, pods and the object store."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.unit.models.round_trip import assert_same_weights
from unirl_core.config.rehearsal import rehearsal_overrides
from unirl_core.models.lora import lora_state_dict
from unirl_core.runtime.build import fresh_bundle, load_policy_weights
from unirl_core.runs.export import main as export_main
from unirl_core.runs.export import version_config, version_ref

POOL = ["pool.execution=pool", "pool.engine.num_cpus=0.5", "pool.trainer.num_cpus=0.5"]
MODES = [pytest.param("pods", marks=pytest.mark.slow), pytest.param("pool", marks=pytest.mark.integration)]
REPO = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"INFO unirl\.progress: step (\d+)/(\d+) \| reward (\S+) \|")


def _rehearse(recipe: str, tmp_path: Path, mode: str) -> tuple[Path, str]:
    """``pyflyte run`` of the rehearsal; returns the run folder and the output."""
    name = f"{recipe}-{uuid.uuid4().hex[:8]}"  # a fresh name keeps flytekit's local cache apart
    overrides = [*rehearsal_overrides(recipe, str(tmp_path)), f"name={name}", *(POOL if mode == "pool" else [])]
    pyflyte = Path(sys.executable).with_name("pyflyte")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([str(pyflyte), "run", "workflows/grpo.py", "grpo", "--recipe", recipe, "--overrides",
                           json.dumps(overrides)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    steps = STEP_LINE.findall(out)
    assert [(int(a), int(b)) for a, b, _ in steps] == [(1, 2), (2, 2)], out[-4000:]
    assert all(math.isfinite(float(r)) for _, _, r in steps), steps
    run = tmp_path / name
    assert (run / "step-00000002" / "manifest.json").is_file() and (run / "report" / "index.html").is_file()
    assert any((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert ("Started a local Ray instance" in out) == (mode == "pool"), out[-3000:]
    return run, out


def _version_bundle(run: Path):
    ref = version_ref(str(run))
    cfg = version_config(ref)
    bundle = fresh_bundle(cfg)
    load_policy_weights(bundle, ref, cfg)
    return ref, cfg, bundle


@pytest.mark.parametrize("recipe,mode", [pytest.param("sd35m-pickscore", "pods", marks=pytest.mark.slow),
                                         pytest.param("sd35m-pickscore", "pool", marks=pytest.mark.integration),
                                         pytest.param("sd35m-ocr", "pods", marks=pytest.mark.slow)])
def test_sd35m_recipe_rehearses_on_cpu_and_its_lora_exports(recipe, mode, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft import PeftModel

    from unirl_core.models.diffusion_tiny import tiny_sd3_pipeline

    run, out = _rehearse(recipe, tmp_path, mode)
    component = "pickscore" if recipe == "sd35m-pickscore" else "ocr"
    assert f"reward/{component}" in (run / "report" / "index.html").read_text()
    ref, cfg, bundle = _version_bundle(run)
    assert ref.step == 2 and cfg.diffusion.model.finetune == "lora" and cfg.diffusion.model.lora.rank == 32

    export_main([str(run), str(tmp_path / "peft")])  # the LoRA run's default format: a peft adapter
    assert json.loads((tmp_path / "peft" / "export.json").read_text())["step"] == 2
    assert cfg.diffusion.model.source == "tiny-sd35"  # SD3.5-Medium's block types at random init
    base = tiny_sd3_pipeline(seed=cfg.diffusion.model.seed, sd35=True).transformer
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "peft"))
    got = {k.replace("base_model.model.", "").replace(".default", ""): v
           for k, v in peft_model.state_dict().items() if "lora_" in k}
    own = lora_state_dict(bundle.module)
    assert got.keys() == own.keys() and all(torch.equal(got[k], own[k]) for k in own)

    export_main([str(run), str(tmp_path / "pipe"), "--format", "diffusers"])
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "pipe"))
    assert_same_weights(pipe.vae, bundle.pipeline.vae, what="vae")


@pytest.mark.parametrize("mode", MODES)
def test_qwen3_math_rehearses_on_cpu_and_exports_a_transformers_model(mode, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, out = _rehearse("qwen3-math", tmp_path, mode)
    report = (run / "report" / "index.html").read_text()
    assert "reward/math" in report and "reward/format" in report
    ref, cfg, bundle = _version_bundle(run)
    assert ref.step == 2 and cfg.lm.model.finetune == "full" and cfg.lm.algorithm.loss_agg == "dapo"

    export_main([str(run), str(tmp_path / "hf")])  # a full fine-tune's default format: transformers
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert_same_weights(model, bundle.module, what="lm")
