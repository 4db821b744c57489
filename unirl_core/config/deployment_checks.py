"""Checks of an LM run with a dedicated engine (vLLM, SGLang or a registered one): what the loop cannot run as configured is refused
with the field, the value and the fix. Called from ``RunConfig.__post_init__``."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from unirl_core.errors import ConfigError, field_error
from unirl_core.rollout.ar import AREngineConfig
from unirl_core.rollout.registry import BUILT_IN_SECTIONS, engine_entry

if TYPE_CHECKING:
    from unirl_core.config.run import LMSection


def check_lm_deployment(lm: LMSection, old_logp_source: str) -> None:
    """Raise ``ConfigError`` for a deployment the loop cannot run as configured (named field + fix)."""
    kind = lm.deployment.engine
    for name in BUILT_IN_SECTIONS:
        if name != kind and getattr(lm, name) is not None:
            raise field_error(ConfigError, f"lm.{name}", "set", f"no '{name}' section with "
                              f"lm.deployment.engine={kind!r}", f"remove lm.{name} or set lm.deployment.engine="
                              f"{name!r} (with mode 'separate' or 'colocate' and a sync block)")
    entry = engine_entry(kind, "lm.deployment.engine")
    if not entry.dedicated:
        return
    section = entry.section
    engine = lm.dedicated
    if engine is None:
        raise field_error(ConfigError, section, None, f"a '{kind}' section with lm.deployment.engine={kind!r}",
                          f"add {section} (see the tiny-grpo-vllm recipe)")
    if old_logp_source != "replay":
        raise field_error(ConfigError, "train.old_logp_source", old_logp_source,
                          f"'replay' with the dedicated engine {kind!r}",
                          "its log-probs come from another kernel stack; pi_old must be the trainer's replay "
                          "(set lm.algorithm.tis_cap to correct the residual mismatch)")
    if entry.check is not None:
        entry.check(engine)
    if engine.tokenizer is not None:
        raise field_error(ConfigError, f"{section}.tokenizer", engine.tokenizer, "None in a training run",
                          "the loop encodes prompts with the trainer's tokenizer (lm.model.tokenizer); set it there")
    _check_trainside_engine_unset(lm, kind, section)
    _check_weight_sync(lm, section, engine)


def _check_trainside_engine_unset(lm: LMSection, kind: str, section: str) -> None:
    """``lm.engine`` configures the trainside engine only: with a dedicated engine every non-default value in it
    would be ignored, so it is refused with where the setting lives instead (``seed``: ``check_rollout_seeds``)."""
    prompt = (f"the {kind} engine encodes prompts with the trainer's tokenizer and {section}.prompt; "
              f"set {section}.prompt.")
    fixes = {"system_prompt": f"{prompt}system_prompt instead",
             "apply_chat_template": f"{prompt}apply_chat_template instead",
             "ignore_eos": "set lm.vllm.ignore_eos instead" if kind == "vllm"
             else f"the {kind} engine does not support ignore_eos; remove it",
             "forward_batch_size": f"the {kind} server batches requests itself ({section}.max_concurrency) and the "
                                   "trainer's replay uses train.micro_batch_size; remove it"}
    defaults = AREngineConfig()
    for f in fields(AREngineConfig):
        value, default = getattr(lm.engine, f.name), getattr(defaults, f.name)
        if f.name != "seed" and value != default:
            raise field_error(ConfigError, f"lm.engine.{f.name}", value,
                              f"the default {default!r} with lm.deployment.engine={kind!r} (lm.engine configures "
                              "the trainside engine, which does not sample here)",
                              fixes.get(f.name, f"it has no counterpart in the {kind} engine; remove it"))


def _check_weight_sync(lm: LMSection, section: str, engine) -> None:
    """Every published version reaches the engine, in the form the trainer checkpoints (adapter or full)."""
    sync = lm.deployment.sync
    assert sync is not None  # validate_deployment requires it for dedicated engines
    if sync.every_n_steps != 1:
        raise field_error(ConfigError, "lm.deployment.sync.every_n_steps", sync.every_n_steps,
                          "1 (the loop publishes every version to the engine)",
                          "off-policy lag between publishes is not implemented in the loop; use 1")
    want = "lora" if lm.model.finetune == "lora" else "reload"
    for field_name, got in (("lm.deployment.sync.method", sync.method), (f"{section}.weight_sync", engine.weight_sync)):
        if got != want:
            raise field_error(ConfigError, field_name, got, f"{want!r} with lm.model.finetune={lm.model.finetune!r}",
                              "checkpoints hold adapters for LoRA runs and full weights otherwise; set both "
                              f"lm.deployment.sync.method and {section}.weight_sync to {want!r}")
    if want == "lora" and lm.deployment.mode == "colocate" and lm.deployment.sleep_level == 2:
        raise field_error(ConfigError, "lm.deployment.sleep_level", 2, "1 with LoRA weight sync",
                          "level 2 drops the base weights, and an adapter publish does not bring them back")
    if want == "lora":
        if engine.lora_alpha is not None and engine.lora_alpha != lm.model.lora_alpha:
            raise field_error(ConfigError, f"{section}.lora_alpha", engine.lora_alpha,
                              f"None or lm.model.lora_alpha ({lm.model.lora_alpha})",
                              "leave it unset; the loop uses the trainer's alpha")
        if engine.max_lora_rank < lm.model.lora_rank:
            raise field_error(ConfigError, f"{section}.max_lora_rank", engine.max_lora_rank,
                              f">= lm.model.lora_rank ({lm.model.lora_rank})", "raise max_lora_rank")
