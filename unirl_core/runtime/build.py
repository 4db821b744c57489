"""What the phases build from a RunConfig: bundles, the trainer's bundle and loss, the store, prompt sets, reward
services, the step-0 export and a dedicated rollout engine (a vLLM / SGLang server).

These are builders. Who keeps what they build is ``runtime.resources.Resources`` (rollout bundles, the trainer, the
engine: state the phases change), owned by an executor or a pool actor. Prompt sets, reward services and a
downloaded export are memoised here by the JSON of their config section: values no phase changes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import posixpath
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
import torch
from torch import Tensor

from unirl_core.algorithms.registry import build_algorithm
from unirl_core.checkpoint import CheckpointRef, CheckpointStore, load_manifest, load_weights
from unirl_core.checkpoint.delta import bits, decode_delta, version_encoding, weights_digest
from unirl_core.checkpoint.store import WEIGHTS, read_delta
from unirl_core.config.loader import config_key
from unirl_core.config.run import RunConfig
from unirl_core.data.prompts import PromptDataset, check_prompts_per_step, load_prompts
from unirl_core.data.sources import prompt_source
from unirl_core.errors import CheckpointError, ConfigError, field_error
from unirl_core.models.diffusion import DiffusionBundle
from unirl_core.models.lm import load_lm
from unirl_core.models.lora import lora_state_dict
from unirl_core.reward.service import RewardService
from unirl_core.rollout.registry import engine_entry
from unirl_core.rollout.weights import write_peft_adapter
from unirl_core.types import PromptRecord

log = logging.getLogger(__name__)

# Memos of values a config defines and no phase changes (a reward service, a prompt set, a downloaded export).
# What phases change - rollout bundles, trainers, a dedicated engine - is owned by a ``runtime.resources.Resources``.
_REWARDS: dict[str, RewardService] = {}
_DATASETS: dict[str, PromptDataset] = {}
_INITIAL_DIRS: dict[str, str] = {}


def fresh_bundle(cfg: RunConfig):
    """A newly built bundle with the model's initial weights (pretrained or seeded tiny init)."""
    model_cfg = cfg.section.model
    return DiffusionBundle.build(model_cfg) if cfg.family == "diffusion" else load_lm(model_cfg)


def train_bundle(cfg: RunConfig):
    """A fresh bundle for a trainer: the initial weights, and (``lm.reference`` set) the KL reference loaded from
    that checkpoint version instead of kept from the initial weights."""
    policy = fresh_bundle(cfg)
    uri = getattr(cfg.section.model, "reference", None)
    if uri is not None:
        where = f"lm.reference={uri!r}"
        ref = CheckpointRef(uri=uri, run=posixpath.basename(posixpath.dirname(uri.rstrip("/"))), step=0,
                            policy_version=0)  # load_weights reads the folder's manifest; only the URI counts
        try:
            weights = load_weights(ref, storage_options=cfg.checkpoint.storage_options)
        except CheckpointError as e:
            raise field_error(CheckpointError, "lm.reference", uri, "a complete checkpoint version",
                              f"write it first (a compose run writes its enhancer's at init), or unset it: {e}") from e
        policy.load_reference_weights(weights, where=where)
    return policy


def algorithm(cfg: RunConfig):
    """The run's loss, built from its section's registered algorithm config (``<family>.algorithm.name``)."""
    return build_algorithm(cfg.section.algorithm)


def rollout_weights(cfg: RunConfig) -> str:
    """``ema`` when the run's algorithm samples with the EMA weights (its ``rollout_weights``), else ``policy``."""
    return getattr(cfg.section.algorithm, "rollout_weights", "policy")


def store(cfg: RunConfig) -> CheckpointStore:
    """The run's store. Retention keeps ``checkpoint.keep_last`` versions, and at least the ``max_policy_lag + 1``
    a lagged rollout may load (version ``step - 1 - lag``)."""
    c = cfg.checkpoint
    return CheckpointStore(c.root, cfg.name, keep_last=max(c.keep_last, cfg.async_training.max_policy_lag + 1),
                           keep_every=c.keep_every, storage_options=c.storage_options,
                           encoding=version_encoding(c.weights_encoding, anchor_every=c.anchor_every))


def reward_service(cfg: RunConfig) -> RewardService:
    key = config_key(cfg.reward)
    if key not in _REWARDS:
        _REWARDS[key] = RewardService(cfg.reward)
    return _REWARDS[key]


def _build_dataset(cfg: RunConfig) -> PromptDataset:
    d = cfg.data
    if d.source == "inline":
        records = [PromptRecord(prompt_id=f"p{i:04d}", prompt=p) for i, p in enumerate(d.prompts)]
        return PromptDataset(records, seed=d.seed)
    if d.source != "file":
        return PromptDataset(prompt_source(d.source).build(d.generator()), seed=d.seed)
    ds = load_prompts(d.file)
    check_prompts_per_step(d.prompts_per_step, len(ds), f"data.file.path={d.file.path!r}")
    return ds


def dataset(cfg: RunConfig) -> PromptDataset:
    key = config_key(cfg.data)
    if key not in _DATASETS:
        _DATASETS[key] = _build_dataset(cfg)
    return _DATASETS[key]


def load_policy_weights(policy, ref: CheckpointRef, cfg: RunConfig, *, ema: bool = False) -> bool:
    """Load a version's (trainable or full) weights, or its EMA weights, into the bundle's module, checking
    every name. The fp32 checkpoint values are rounded into the module's own dtype on copy.

    A delta version (``checkpoint.weights_encoding: delta``) whose base the module holds (``held_weights``) is
    applied as the delta alone - its file read, XOR-ed into the module's tensors in place - and the result checked
    against the version's digest; else (another base, other dtypes, a digest that does not match) the version is
    read in full. Returns True when the delta was applied."""
    if ema and cfg.train.ema_decay is None:
        raise field_error(ConfigError, "train.ema_decay", None, "a decay, to sample with EMA weights",
                          "set train.ema_decay (e.g. 0.95) so checkpoints carry EMA weights")
    opts = cfg.checkpoint.storage_options
    if not ema and apply_version_delta(policy, ref, cfg):
        return True
    weights: dict[str, Tensor] = load_weights(ref, storage_options=opts, ema=ema)
    apply_policy_weights(policy, weights, where=ref.uri)
    if not ema:
        # the module holds the version rounded into its dtypes: what a delta against it XORs against when the
        # delta's dtypes are the module's (``_apply_delta`` checks them, and the result's digest)
        _HELD[policy.module] = load_manifest(ref, storage_options=opts).weights_sha256(WEIGHTS)
    return False


_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""module -> weights digest of the version it holds (rounded into the module's dtypes), set by
``load_policy_weights`` only; any other write into the module's weights forgets it (``forget_held_weights``)."""


def held_weights(module) -> str | None:
    """The weights digest of the version ``module`` holds, when ``load_policy_weights`` put it there."""
    return _HELD.get(module)


def forget_held_weights(module) -> None:
    """``module``'s weights are being changed by someone else than ``load_policy_weights`` (an in-pool publish)."""
    _HELD.pop(module, None)


def apply_version_delta(policy, ref: CheckpointRef, cfg: RunConfig, *, held: str | None = None) -> bool:
    """Bring the bundle's module to version ``ref`` with the version's delta alone, when ``ref`` is a delta version
    whose base the module holds (``held``: that base's digest, when the caller knows the module holds it - an engine
    that received it in-pool; else what ``load_policy_weights`` recorded). True once the result matched the
    version's digest; False leaves the module as it was, or (a digest mismatch) holding no version."""
    opts = cfg.checkpoint.storage_options
    manifest = load_manifest(ref, storage_options=opts)
    if manifest.delta is None:
        return False
    if held is not None:
        _HELD[policy.module] = held
    if _HELD.get(policy.module) != manifest.delta["base_sha256"]:
        return False  # not at the base: the delta file is not read
    manifest, blob = read_delta(ref, storage_options=opts)
    return blob is not None and _apply_delta(policy.module, manifest, blob, where=ref.uri)


def version_digest(ref: CheckpointRef, cfg: RunConfig) -> str | None:
    """The weights digest of version ``ref`` (only its URI counts) from its manifest; None while the version is
    not (yet) complete."""
    try:
        return load_manifest(ref, storage_options=cfg.checkpoint.storage_options).weights_sha256(WEIGHTS)
    except (CheckpointError, FileNotFoundError):
        return None


def _apply_delta(module, manifest, blob: bytearray, *, where: str) -> bool:
    """Bring ``module`` from the delta's base to its version in place, when it holds that base in the delta's
    dtypes; True once the result matched the version's digest. A mismatch is logged and returns False (the module
    then holds no version: the caller loads it in full)."""
    if _HELD.get(module) != manifest.delta["base_sha256"]:
        return False
    xors = decode_delta(blob, int(manifest.delta["bytes"]), f"{where}/{manifest.delta['file']}")
    state = module.state_dict()
    if any(n not in state or state[n].dtype != x.dtype or state[n].shape != x.shape for n, x in xors.items()):
        return False
    _HELD.pop(module, None)
    seen = set()
    with torch.no_grad():
        for name, x in xors.items():
            t = state[name]
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key in seen:  # a tied weight: one storage under two names, XOR-ed once
                continue
            seen.add(key)
            bits(t).bitwise_xor_(bits(x.to(t.device)))
    got = weights_digest({n: state[n] for n in xors})
    if got != manifest.delta["sha256"]:
        log.warning("delta of %s applied to the module's weights gives sha256 %s, the version's is %s; reading "
                    "the version in full", where, got, manifest.delta["sha256"])
        return False
    _HELD[module] = got
    return True


def apply_policy_weights(policy, weights: dict[str, Tensor], *, where: str) -> None:
    """Copy (trainable or full) weights into the bundle's module, rounded to its dtype; every trainable
    parameter must get a tensor and every tensor must name a parameter (``where`` says whose weights)."""
    module = policy.module
    _HELD.pop(module, None)
    result = module.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise field_error(CheckpointError, f"{where}: weights", result.unexpected_keys[:5],
                          "parameter names of this model", "load a checkpoint of the same model / LoRA layout")
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(weights))
    if missing:
        raise field_error(CheckpointError, f"{where}: weights", missing[:5], "a tensor for every trainable "
                          "parameter", "the checkpoint was written with another trainable layout")


# ----------------------------------------------------------------------------- the step-0 policy as a HF folder

INITIAL_POLICY_DIR = "hf-init"
"""Folder (next to the ``step-*`` versions, which the store ignores) holding the run's step-0 policy in the
``save_pretrained`` layout: what a dedicated engine starts from when ``lm.vllm.model`` is unset."""
_EXPORT_MARKER = "export.json"


def initial_policy_uri(cfg: RunConfig) -> str:
    return posixpath.join(store(cfg).uri, INITIAL_POLICY_DIR)


def needs_initial_policy(cfg: RunConfig) -> bool:
    """True when the run's dedicated engine starts from the exported step-0 policy (``lm.vllm.model`` unset)."""
    if cfg.family != "lm" or cfg.lm.dedicated is None:
        return False
    return engine_entry(cfg.lm.deployment.engine).serves_initial_policy and cfg.lm.dedicated.model is None


def initial_policy_exported(cfg: RunConfig) -> bool:
    fs, path = fsspec.core.url_to_fs(initial_policy_uri(cfg), **cfg.checkpoint.storage_options)
    return fs.exists(posixpath.join(path, _EXPORT_MARKER))


def export_initial_policy(cfg: RunConfig, policy) -> str:
    """Write ``policy`` (an ``LMBundle``; LoRA merged) to ``initial_policy_uri`` unless a complete export is
    there. The marker file goes last, so an interrupted export is redone, never used."""
    uri = initial_policy_uri(cfg)
    if initial_policy_exported(cfg):
        return uri
    fs, path = fsspec.core.url_to_fs(uri, **cfg.checkpoint.storage_options)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    with tempfile.TemporaryDirectory(prefix="unirl-hf-init-") as tmp:
        policy.save_pretrained(tmp)
        files = {}
        for name in sorted(os.listdir(tmp)):
            local = os.path.join(tmp, name)
            if not os.path.isfile(local):
                raise field_error(CheckpointError, f"{uri}/{name}", "a folder", "a flat save_pretrained folder",
                                  "export models whose save_pretrained writes files only")
            fs.makedirs(path, exist_ok=True)
            fs.put_file(local, posixpath.join(path, name))
            files[name] = os.path.getsize(local)
    fs.pipe_file(posixpath.join(path, _EXPORT_MARKER), json.dumps({"files": files}, sort_keys=True).encode())
    log.info("exported the step-0 policy to %s (%.1f MB)", uri, sum(files.values()) / 1e6)
    return uri


def initial_policy_dir(cfg: RunConfig) -> str:
    """A local folder with the exported step-0 policy (downloaded once per process from a remote root)."""
    uri = initial_policy_uri(cfg)
    fs, path = fsspec.core.url_to_fs(uri, **cfg.checkpoint.storage_options)
    try:
        marker = json.loads(fs.cat_file(posixpath.join(path, _EXPORT_MARKER)))
    except FileNotFoundError:
        raise field_error(CheckpointError, uri, "no complete export", f"the step-0 policy exported by init_run "
                          f"({_EXPORT_MARKER} present)", "run init_run for this run first, or set lm.vllm.model") from None
    if isinstance(fs, LocalFileSystem):
        return path
    if uri not in _INITIAL_DIRS:
        local = tempfile.mkdtemp(prefix="unirl-hf-init-")
        for name in marker["files"]:
            fs.get_file(posixpath.join(path, name), os.path.join(local, name))
        _INITIAL_DIRS[uri] = local
    return _INITIAL_DIRS[uri]


# ----------------------------------------------------------------------------- the dedicated engine

UNSYNCED_VERSION = -1
"""Label of a freshly started engine: no checkpoint has it, so the first rollout always syncs (a started
server serves its start folder, whose version the loop cannot prove)."""


@dataclass
class EngineSlot:
    """A started dedicated engine and what it serves."""

    key: str
    engine: Any
    """The started dedicated engine (``unirl_core.rollout.registry``: what the loop asks of one)."""
    staging: Path
    """The engine's ``staging_dir``: where published weights are unpacked for the server (``policy-v<N>``)."""
    owns_staging: bool = False
    """The loop made ``staging`` (a temporary folder) and removes it on close."""
    served_uri: str | None = None
    """URI of the checkpoint version last synced to the engine (None: its start folder)."""
    asleep_level: int = 0
    """Sleep level the engine was put in after its last rollout (colocate), 0 when awake."""

    def needs_sync(self, ckpt: CheckpointRef) -> bool:
        # Level 2 sleep drops the weights, so even the same version must be reloaded.
        return (self.engine.policy_version != ckpt.policy_version or self.served_uri != ckpt.uri
                or self.asleep_level == 2)

    def publish_source(self, cfg: RunConfig, policy, ckpt: CheckpointRef) -> CheckpointRef | Path:
        """What ``update_weights`` gets: the ref itself for full weights; for LoRA a peft folder written from
        ``policy``, which holds ``ckpt``'s (checksum-verified) weights.

        Why not the ref for LoRA: with a tied LM head the trainer's trainable-only checkpoints also carry the
        frozen ``lm_head.weight`` (torch's ``ignore_frozen_params`` keeps a tied weight's second name), and
        ``stage_weights`` rightly refuses adapter checkpoints with base tensors in them.
        """
        if self.engine.config.weight_sync != "lora":
            return ckpt
        out = self.staging / f"policy-v{ckpt.policy_version:08d}"
        if out.exists():
            shutil.rmtree(out)
        return write_peft_adapter(lora_state_dict(policy.module), out, alpha=cfg.lm.model.lora_alpha,
                                  base_model=str(self.engine.config.model))

    def prune_staging(self) -> None:
        """Delete staged versions other than the served one: once loaded they live in server memory, and a
        full-weight copy per step would fill the disk on a long run."""
        keep = f"policy-v{self.engine.policy_version:08d}"
        for old in self.staging.glob("policy-v*"):
            if old.name != keep and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)


def start_engine(cfg: RunConfig, policy) -> EngineSlot:
    """Start the engine of ``cfg.lm.deployment`` (its registered ``build``); ``Resources.dedicated_engine`` keeps it.

    Prompts are encoded with ``policy.tokenizer`` (the trainer's), so ``prompt_ids`` are what the trainer replays.
    """
    lm = cfg.lm
    kind = lm.deployment.engine
    engine_cfg = lm.dedicated
    if engine_cfg is None:
        raise field_error(ConfigError, f"lm.{kind}", None, "a dedicated engine section", "see RunConfig validation")
    owns = engine_cfg.staging_dir is None
    changes = {"staging_dir": tempfile.mkdtemp(prefix="unirl-engine-weights-") if owns else engine_cfg.staging_dir}
    if needs_initial_policy(cfg):
        changes["model"] = initial_policy_dir(cfg)
    if engine_cfg.weight_sync == "lora" and engine_cfg.lora_alpha is None:
        changes["lora_alpha"] = lm.model.lora_alpha
    engine_cfg = dataclasses.replace(engine_cfg, **changes)
    build = engine_entry(kind).build
    log.info("starting the %s engine from %s", kind, engine_cfg.model)
    try:
        engine = build(engine_cfg, policy_version=UNSYNCED_VERSION, tokenizer=policy.tokenizer)
    except BaseException:
        if owns:
            shutil.rmtree(engine_cfg.staging_dir, ignore_errors=True)
        raise
    return EngineSlot(key=engine_key(cfg), engine=engine, staging=Path(engine_cfg.staging_dir), owns_staging=owns)


def engine_key(cfg: RunConfig) -> str:
    """What a started engine is for: its kind, what it starts from and its section (another key: another engine)."""
    engine_cfg = cfg.lm.dedicated
    source = initial_policy_uri(cfg) if needs_initial_policy(cfg) else engine_cfg.model
    return f"{cfg.lm.deployment.engine}:{source}:{config_key(engine_cfg)}"


def stop_engine(slot: EngineSlot) -> None:
    """Stop ``slot``'s engine (its server, when the engine started one) and remove its staging folder if ours."""
    try:
        slot.engine.close()
    finally:
        if slot.owns_staging:
            shutil.rmtree(slot.staging, ignore_errors=True)
