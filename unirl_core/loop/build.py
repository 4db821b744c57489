"""Build (and cache per process) what the phases need from a RunConfig: bundles, data, scorers.

Phases are stateless between calls (each Flyte task is its own process); within one process the
built bundle is reused and only its weights are reloaded from the checkpoint a phase is given.
"""

from __future__ import annotations

import json
import logging

from torch import Tensor

from unirl_core.algorithms.flow_grpo import FlowGRPO
from unirl_core.algorithms.grpo import GRPO
from unirl_core.checkpoint import CheckpointRef, CheckpointStore, load_weights
from unirl_core.config.loader import to_dict
from unirl_core.config.run import RunConfig
from unirl_core.data.prompts import PromptDataset, load_prompts
from unirl_core.data.toy import toy_arithmetic_prompts
from unirl_core.errors import CheckpointError, field_error
from unirl_core.models.diffusion import DiffusionBundle
from unirl_core.models.lm import load_lm
from unirl_core.reward.service import RewardService
from unirl_core.types import PromptRecord

log = logging.getLogger(__name__)

_BUNDLES: dict[str, object] = {}
_REWARDS: dict[str, RewardService] = {}
_DATASETS: dict[str, PromptDataset] = {}


def _key(obj: object) -> str:
    return json.dumps(to_dict(obj), sort_keys=True, default=str)


def fresh_bundle(cfg: RunConfig):
    """A newly built bundle with the model's initial weights (pretrained or seeded tiny init)."""
    model_cfg = cfg.section.model
    return DiffusionBundle.build(model_cfg) if cfg.family == "diffusion" else load_lm(model_cfg)


def bundle(cfg: RunConfig):
    """The run's bundle (a Policy), built once per process and model config. Its trainable weights are
    whatever the last phase loaded: always load a checkpoint into it before use."""
    key = f"{cfg.family}:{_key(cfg.section.model)}"
    if key not in _BUNDLES:
        _BUNDLES[key] = fresh_bundle(cfg)
    return _BUNDLES[key]


def algorithm(cfg: RunConfig):
    return FlowGRPO(cfg.diffusion.algorithm) if cfg.family == "diffusion" else GRPO(cfg.lm.algorithm)


def store(cfg: RunConfig) -> CheckpointStore:
    c = cfg.checkpoint
    return CheckpointStore(c.root, cfg.name, keep_last=c.keep_last, keep_every=c.keep_every,
                           storage_options=c.storage_options)


def reward_service(cfg: RunConfig) -> RewardService:
    key = _key(cfg.reward)
    if key not in _REWARDS:
        _REWARDS[key] = RewardService(cfg.reward)
    return _REWARDS[key]


def _build_dataset(cfg: RunConfig) -> PromptDataset:
    d = cfg.data
    if d.source == "inline":
        records = [PromptRecord(prompt_id=f"p{i:04d}", prompt=p) for i, p in enumerate(d.prompts)]
        return PromptDataset(records, seed=d.seed)
    if d.source == "toy_arithmetic":
        return PromptDataset(toy_arithmetic_prompts(d.toy), seed=d.seed)
    return load_prompts(d.file)


def dataset(cfg: RunConfig) -> PromptDataset:
    key = _key(cfg.data)
    if key not in _DATASETS:
        _DATASETS[key] = _build_dataset(cfg)
    return _DATASETS[key]


def load_policy_weights(policy, ref: CheckpointRef, cfg: RunConfig) -> None:
    """Load a version's (trainable or full) weights into the bundle's module, checking every name."""
    weights: dict[str, Tensor] = load_weights(ref, storage_options=cfg.checkpoint.storage_options)
    module = policy.module
    result = module.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise field_error(CheckpointError, f"{ref.uri}: weights", result.unexpected_keys[:5],
                          "parameter names of this model", "load a checkpoint of the same model / LoRA layout")
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(weights))
    if missing:
        raise field_error(CheckpointError, f"{ref.uri}: weights", missing[:5], "a tensor for every trainable "
                          "parameter", "the checkpoint was written with another trainable layout")
