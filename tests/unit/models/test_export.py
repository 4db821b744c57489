"""An RL run's version exported as a peft / diffusers / transformers folder, loaded back with the library's own
``from_pretrained``, computes what the project's rollout bundle computes; a run starts from an exported adapter.

Tolerances: the weights are compared bitwise (what a wrong or missing weight would break). Outputs come from two
module instances, which CPU kernels need not make bitwise equal (``round_trip.py``: up to ~5e-7 measured, checked
within its ``OUTPUT_ATOL`` = 1e-5); a merged export (``W + s * B @ A`` folded into one matrix) also rounds
differently from the adapter's ``W x + s * B (A x)``, fp32 rounding of the same size at these magnitudes.
Measured on an AMD EPYC (fp32): the peft adapters and the full exports gave bitwise-equal outputs; the merged
exports differ by at most 2.4e-7 (SD3 velocity, |v| <= 1.6) and 3.0e-7 (LM logits, |logit| <= 0.93).
"""

import json

import pytest
import torch

from unirl_core.config.recipes import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local
from unirl_core.loop.run_init import init_run
from unirl_core.models.lora import has_lora, lora_state_dict
from unirl_core.runtime.build import fresh_bundle, load_policy_weights
from unirl_core.runs.export import export_version, main, version_config, version_ref
from tests.unit.models.round_trip import assert_outputs_close, assert_same_weights

SIGMA = torch.tensor(0.6)


def _run(tmp_path, recipe: str, name: str, *overrides: str):
    cfg = load_recipe(recipe, [f"name={name}", f"checkpoint.root={tmp_path / 'runs'}", "loop.total_steps=1",
                               "loop.steps_per_chunk=1", "report.progress=false", *overrides])
    run_local(cfg, progress=False)
    return cfg


def _bundle_at(cfg, uri):
    bundle = fresh_bundle(cfg)
    load_policy_weights(bundle, version_ref(uri), cfg)
    return bundle


def _assert_trained(cfg, bundle):
    """The version differs from the step-0 weights: the export round trip is not checked on an initial model."""
    start = fresh_bundle(cfg).module.state_dict()
    moved = [k for k, v in bundle.module.state_dict().items() if not torch.equal(v, start[k])]
    assert moved and (cfg.section.model.finetune != "lora" or any("lora_B" in k for k in moved))


# ----------------------------------------------------------------------------------------------- diffusion

DIFFUSION = ("data.prompts_per_step=1", "data.samples_per_prompt=2", "diffusion.sampling.num_steps=2",
             "train.micro_batch_size=2", "diffusion.engine.forward_batch_size=2")


def _sd3_inputs(bundle):
    torch.manual_seed(0)
    per = bundle.encode_text(["a red fox", "a lighthouse"])
    conds = {k: torch.stack([c[k] for c in per]) for k in per[0]}
    return torch.randn(2, 4, 8, 8), conds


def _library_velocity(transformer, x, conds):
    with torch.no_grad():
        return transformer(hidden_states=x, timestep=(SIGMA * 1000).expand(2), return_dict=False,
                           encoder_hidden_states=conds["prompt_embeds"],
                           pooled_projections=conds["pooled_prompt_embeds"])[0]


def _project_velocity(bundle, x, conds):
    with torch.no_grad():
        return bundle.guided_velocity(x, SIGMA, conds, guidance_scale=1.0)


@pytest.fixture(scope="module")
def lora_diffusion_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export-diffusion")
    cfg = _run(tmp, "tiny-flow-grpo", "exp-lora", *DIFFUSION, "diffusion.model.finetune=lora",
               "diffusion.model.lora.rank=4")
    return cfg, tmp


def test_diffusion_lora_exports_a_peft_adapter_and_a_merged_pipeline(lora_diffusion_run, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft import PeftModel

    from unirl_core.models.diffusion_tiny import tiny_sd3_pipeline

    cfg, tmp = lora_diffusion_run
    run = str(tmp / "runs" / cfg.name)
    ref = version_ref(run)
    assert ref.step == 1  # the run folder's latest version: trained, not the step-0 adapter
    bundle = _bundle_at(cfg, ref.uri)
    x, conds = _sd3_inputs(bundle)
    want = _project_velocity(bundle, x, conds)
    _assert_trained(cfg, bundle)

    # peft: the adapter over the base transformer the run started from (the tiny preset, seed 0)
    main([run, str(tmp_path / "peft"), "--format", "peft"])
    marker = json.loads((tmp_path / "peft" / "export.json").read_text())
    assert marker["format"] == "peft" and marker["version_uri"] == ref.uri and marker["step"] == 1
    assert version_ref(ref.uri) == ref  # a version folder reads its step and policy version from its manifest
    peft_model = PeftModel.from_pretrained(tiny_sd3_pipeline(seed=0).transformer, str(tmp_path / "peft")).eval()
    got = {k.replace("base_model.model.", "").replace(".default", ""): v
           for k, v in peft_model.state_dict().items() if "lora_" in k}
    own = lora_state_dict(bundle.module)
    assert got.keys() == own.keys() and all(torch.equal(got[k], own[k]) for k in own)
    assert_outputs_close(_library_velocity(peft_model, x, conds), want)

    # diffusers: the whole pipeline, LoRA merged
    export_version(run, str(tmp_path / "pipe"), "diffusers")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "pipe"))
    assert not has_lora(pipe.transformer)
    assert_same_weights(pipe.vae, bundle.pipeline.vae, what="vae")
    assert_outputs_close(_library_velocity(pipe.transformer, x, conds), want)


def test_diffusion_full_run_exports_a_pipeline(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    cfg = _run(tmp_path, "tiny-flow-grpo", "exp-full", *DIFFUSION)
    run = str(tmp_path / "runs" / cfg.name)
    export_version(run, str(tmp_path / "pipe"))  # default format of a full fine-tune: diffusers
    bundle = _bundle_at(cfg, version_ref(run).uri)
    _assert_trained(cfg, bundle)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "pipe"))
    assert_same_weights(pipe.transformer, bundle.module, what="transformer")
    x, conds = _sd3_inputs(bundle)
    assert_outputs_close(_library_velocity(pipe.transformer, x, conds), _project_velocity(bundle, x, conds))
    with pytest.raises(ConfigError, match="LoRA run"):
        export_version(run, str(tmp_path / "peft"), "peft")
    with pytest.raises(ConfigError, match="an LM run"):
        export_version(run, str(tmp_path / "tf"), "transformers")


def test_run_starts_from_an_exported_diffusion_adapter(lora_diffusion_run, tmp_path):
    cfg, tmp = lora_diffusion_run
    run = str(tmp / "runs" / cfg.name)
    export_version(run, str(tmp_path / "adapter"), "peft")
    trained = lora_state_dict(_bundle_at(cfg, version_ref(run).uri).module)
    child = load_recipe("tiny-flow-grpo", ["name=exp-child", f"checkpoint.root={tmp_path / 'runs'}", *DIFFUSION,
                                           "diffusion.model.finetune=lora", "diffusion.model.lora.rank=4",
                                           f"diffusion.model.adapter={tmp_path / 'adapter'}"])
    step0 = init_run(child)
    assert step0.step == 0
    start = lora_state_dict(_bundle_at(child, step0.uri).module)
    assert start.keys() == trained.keys() and all(torch.equal(start[k], trained[k]) for k in trained)
    with pytest.raises(ConfigError, match=r"diffusion\.model\.adapter.*'r': 4"):
        fresh_bundle(load_recipe("tiny-flow-grpo", ["diffusion.model.finetune=lora", "diffusion.model.lora.rank=8",
                                                    f"diffusion.model.adapter={tmp_path / 'adapter'}"]))
    with pytest.raises(ConfigError, match=r"diffusion\.model\.adapter"):
        load_recipe("tiny-flow-grpo", [f"diffusion.model.adapter={tmp_path / 'adapter'}"])  # finetune: full
    with pytest.raises(ConfigError, match=r"diffusion\.model\.adapter.*peft adapter folder"):
        fresh_bundle(load_recipe("tiny-flow-grpo", ["diffusion.model.finetune=lora",
                                                    f"diffusion.model.adapter={tmp_path / 'missing'}"]))


# ----------------------------------------------------------------------------------------------- LM

# 2 steps of 4 x 8 samples: with seed 0 some toy-arithmetic rewards are non-zero, so the weights move (a step whose
# rewards are all 0 has zero advantages and would export the initial weights).
LM = ("data.prompts_per_step=4", "data.samples_per_prompt=8", "train.micro_batch_size=16",
      "lm.engine.forward_batch_size=16")


def _lm_inputs():
    return torch.tensor([[5, 9, 13, 2, 7, 11], [3, 4, 8, 16, 1, 6]])


def _project_logits(bundle, ids):
    with torch.no_grad(), bundle.compute():
        return bundle.module(ids).logits


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_lm_exports_a_transformers_model_and_a_peft_adapter(tmp_path, finetune):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unirl_core.models.lm import LMConfig, load_lm

    extra = ("lm.model.finetune=lora", "lm.model.lora_rank=4") if finetune == "lora" else ()
    cfg = _run(tmp_path, "tiny-grpo", f"exp-lm-{finetune}", *LM, *extra, "loop.total_steps=2")
    run = str(tmp_path / "runs" / cfg.name)
    bundle = _bundle_at(cfg, version_ref(run).uri)
    _assert_trained(cfg, bundle)
    ids = _lm_inputs()
    want = _project_logits(bundle, ids)

    main([run, str(tmp_path / "hf"), "--format", "transformers"])
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    if finetune == "full":
        assert_same_weights(model, bundle.module, what="lm")
    with torch.no_grad():
        assert_outputs_close(model(ids).logits, want)
    if finetune == "full":
        with pytest.raises(ConfigError, match="LoRA run"):
            export_version(run, str(tmp_path / "peft"), "peft")
        return

    export_version(run, str(tmp_path / "peft"))  # default format of a LoRA run: peft
    assert json.loads((tmp_path / "peft" / "export.json").read_text())["format"] == "peft"
    base = load_lm(LMConfig(model="tiny", finetune="full", keep_reference=False, seed=cfg.lm.model.seed)).module
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        assert_outputs_close(peft_model(ids).logits, want)

    # a new run starts from the adapter: its step-0 LoRA is the exported one
    child = load_recipe("tiny-grpo", ["name=exp-lm-child", f"checkpoint.root={tmp_path / 'runs'}", *LM, *extra,
                                      f"lm.model.adapter={tmp_path / 'peft'}"])
    step0 = init_run(child)
    start, trained = lora_state_dict(_bundle_at(child, step0.uri).module), lora_state_dict(bundle.module)
    assert step0.step == 0 and start.keys() == trained.keys()
    assert all(torch.equal(start[k], trained[k]) for k in trained)
    with pytest.raises(ConfigError, match=r"lm\.model\.adapter.*target_modules"):
        fresh_bundle(load_recipe("tiny-grpo", ["lm.model.finetune=lora", "lm.model.lora_rank=4",
                                               "lm.model.lora_target_modules=[q_proj]",
                                               f"lm.model.adapter={tmp_path / 'peft'}"]))


def test_version_config_reads_the_runs_own_config(lora_diffusion_run):
    cfg, tmp = lora_diffusion_run
    got = version_config(version_ref(str(tmp / "runs" / cfg.name)))
    assert got.diffusion.model == cfg.diffusion.model and got.name == cfg.name


def test_flux_lora_adapter_loads_into_peft_with_every_tensor(tmp_path):
    """Flux's LoRA also wraps MLP projections (``LORA_TARGETS['flux']``); the peft folder must name them all."""
    from peft import PeftModel

    from unirl_core.models.diffusion_tiny import tiny_flux_pipeline

    cfg = _run(tmp_path, "tiny-flow-grpo", "exp-flux", *DIFFUSION, "diffusion.model.source=tiny-flux",
               "diffusion.model.finetune=lora", "diffusion.model.lora.rank=4")
    run = str(tmp_path / "runs" / cfg.name)
    bundle = _bundle_at(cfg, version_ref(run).uri)
    _assert_trained(cfg, bundle)
    export_version(run, str(tmp_path / "peft"))
    peft_model = PeftModel.from_pretrained(tiny_flux_pipeline(seed=0).transformer, str(tmp_path / "peft")).eval()
    got = {k.replace("base_model.model.", "").replace(".default", ""): v
           for k, v in peft_model.state_dict().items() if "lora_" in k}
    own = lora_state_dict(bundle.module)
    assert got.keys() == own.keys() and all(torch.equal(got[k], own[k]) for k in own)
    child = load_recipe("tiny-flow-grpo", ["name=exp-flux-child", f"checkpoint.root={tmp_path / 'runs'}", *DIFFUSION,
                                           "diffusion.model.source=tiny-flux", "diffusion.model.finetune=lora",
                                           "diffusion.model.lora.rank=4", f"diffusion.model.adapter={tmp_path / 'peft'}"])
    start = lora_state_dict(fresh_bundle(child).module)
    assert all(torch.equal(start[k], own[k]) for k in own)
