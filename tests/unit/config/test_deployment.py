"""Deployment choice of LM runs (trainside vs a dedicated vLLM / SGLang engine): what RunConfig accepts."""

from __future__ import annotations

import pytest

from unirl_core.config import load_recipe, load_recipe_dict, to_dict
from unirl_core.errors import ConfigError
from unirl_core.rollout.modes import DeploymentConfig
from unirl_core.rollout.vllm import VLLMEngine, VLLMEngineConfig

LORA = ["lm.model.finetune=lora", "lm.model.lora_rank=8", "lm.deployment.sync.method=lora",
        "lm.vllm.weight_sync=lora", "lm.vllm.max_lora_rank=8"]


def test_trainside_is_the_default():
    cfg = load_recipe("tiny-grpo")
    assert cfg.lm.deployment == DeploymentConfig()
    assert cfg.lm.deployment.engine == "trainside" and cfg.lm.vllm is None and cfg.lm.dedicated is None


def test_vllm_recipe_is_a_replay_run_with_tis_and_an_unset_model():
    cfg = load_recipe("tiny-grpo-vllm")
    dep = cfg.lm.deployment
    assert (dep.mode, dep.engine, dep.sync.method) == ("separate", "vllm", "reload")
    assert cfg.lm.dedicated is cfg.lm.vllm and cfg.lm.vllm.model is None  # the loop's step-0 export
    assert cfg.train.old_logp_source == "replay" and cfg.lm.algorithm.tis_cap == 2.0
    # vLLM's CPU attention needs head_dim 32, 64, 80, ...
    assert cfg.lm.model.tiny.hidden_size // cfg.lm.model.tiny.num_heads == 32
    assert to_dict(cfg)["lm"]["vllm"]["model"] is None


def test_lora_vllm_run_and_colocate_are_accepted():
    cfg = load_recipe("tiny-grpo-vllm", LORA)
    assert cfg.lm.vllm.weight_sync == "lora"
    cfg = load_recipe("tiny-grpo-vllm", ["lm.deployment.mode=colocate", "lm.deployment.sleep_level=2"])
    assert cfg.lm.deployment.mode == "colocate"


@pytest.mark.parametrize("override, message", [
    (["train.old_logp_source=rollout"],
     r"train.old_logp_source='rollout': expected 'replay' with the dedicated engine 'vllm'; .*tis_cap"),
    (["lm.vllm=null"], r"lm.vllm=None: expected a 'vllm' section with lm.deployment.engine='vllm'"),
    (["lm.deployment.engine=trainside", "lm.deployment.mode=direct", "lm.deployment.sync=null"],
     r"lm.vllm='set': expected no 'vllm' section with lm.deployment.engine='trainside'"),
    (["lm.deployment.mode=direct"], r"deployment.engine='vllm': expected 'trainside' with mode='direct'"),
    (["lm.deployment.sync=null"], r"deployment.sync=None: expected a SyncConfig with mode='separate'"),
    (["lm.deployment.sync.method=lora"],
     r"lm.deployment.sync.method='lora': expected 'reload' with lm.model.finetune='full'"),
    (["lm.model.finetune=lora", "lm.deployment.sync.method=lora"],
     r"lm.vllm.weight_sync='reload': expected 'lora' with lm.model.finetune='lora'"),
    (LORA + ["lm.vllm.lora_alpha=4.0"], r"lm.vllm.lora_alpha=4.0: expected None or lm.model.lora_alpha \(32.0\)"),
    (LORA + ["lm.model.lora_rank=16"], r"lm.vllm.max_lora_rank=8: expected >= lm.model.lora_rank \(16\)"),
    (LORA + ["lm.deployment.mode=colocate", "lm.deployment.sleep_level=2"],
     r"lm.deployment.sleep_level=2: expected 1 with LoRA weight sync"),
    (["lm.deployment.sync.every_n_steps=2", "lm.deployment.sync.max_policy_lag=2"],
     r"lm.deployment.sync.every_n_steps=2: expected 1 \(the loop publishes every version"),
    (["lm.vllm.tokenizer=tiny"], r"lm.vllm.tokenizer='tiny': expected None in a training run"),
    (["lm.logp_check.max_abs_diff=-1"], r"logp_check.max_abs_diff=-1.0: expected a finite value >= 0"),
    (["lm.vllm.dtype=int8"], r"recipe.lm.vllm.dtype='int8': expected one of"),
])
def test_bad_deployments_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny-grpo-vllm", override)


def _sglang(**section) -> list[str]:
    over = ["lm.deployment.engine=sglang", "lm.vllm=null"]
    return over + [f"lm.sglang.{k}={v}" for k, v in section.items()]


def test_sglang_only_attaches_to_a_running_server():
    with pytest.raises(ConfigError, match=r"lm.sglang.base_url=None: expected the URL of a running SGLang server; "
                                          r"the loop attaches to SGLang but does not start it"):
        load_recipe("tiny-grpo-vllm", _sglang(model="/models/policy"))
    cfg = load_recipe("tiny-grpo-vllm", _sglang(model="/models/policy", base_url="http://10.0.0.5:30000"))
    assert cfg.lm.dedicated is cfg.lm.sglang and cfg.lm.sglang.base_url == "http://10.0.0.5:30000"
    with pytest.raises(ConfigError, match=r"lm.sglang=None: expected a 'sglang' section"):
        load_recipe("tiny-grpo-vllm", _sglang())


def test_vllm_section_needs_the_vllm_engine_and_sglang_section_the_sglang_engine():
    data = load_recipe_dict("tiny-grpo-vllm")
    data["lm"]["sglang"] = {"model": "m", "base_url": "http://127.0.0.1:30000"}
    from unirl_core.config import RunConfig, from_dict

    with pytest.raises(ConfigError, match=r"lm.sglang='set': expected no 'sglang' section with "
                                          r"lm.deployment.engine='vllm'"):
        from_dict(RunConfig, data, "recipe")


def test_unset_vllm_model_is_refused_outside_the_loop():
    # The loop fills the model in; a standalone engine must say what to serve (and fails before any start).
    with pytest.raises(ConfigError, match=r"vllm.model=None: expected a model directory or hub id to start from"):
        VLLMEngine(VLLMEngineConfig())
    with pytest.raises(ConfigError, match=r"vllm.model='': expected a model directory, a hub id or None"):
        VLLMEngineConfig(model="")
