"""SFT phases: start (or resume) a run, train a chunk of steps, publish, export the model for RL.

Each function takes the ``SFTConfig`` plus typed inputs; the Flyte tasks in ``tasks/sft.py`` call exactly one
of them and ``run_sft`` (``local.py``) chains them in-process. Versions land in the same ``CheckpointStore``
layout as RL runs (``<root>/<run>/step-XXXXXXXX``, manifest last, ``LATEST`` pointer); ``export_model`` turns a
version into a folder the RL loop loads as its initial model (``diffusion.model.source`` / ``lm.model.model``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from unirl_core.checkpoint import (
    CheckpointRef,
    CheckpointStore,
    load_version_json,
    load_weights,
    restore_train_checkpoint,
    save_train_checkpoint,
)
from unirl_core.config.loader import config_key, to_dict
from unirl_core.errors import CheckpointError, ConfigError, field_error
from unirl_core.runtime.build import apply_policy_weights, fresh_bundle
from unirl_core.models.export import write_export
from unirl_core.sft.config import SFTConfig
from unirl_core.sft.losses import CompletionSFT, FlowMatchingSFT
from unirl_core.sft.records import Record, load_records, supervised_batch
from unirl_core.train.backend import TrainBackend
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

EXPORT_DIR = "export"
"""Folder next to the versions holding the last exported model (``save_pretrained`` layout)."""

def algorithm(cfg: SFTConfig):
    return FlowMatchingSFT(cfg.diffusion.loss, seed=cfg.loop.seed) if cfg.family == "diffusion" else CompletionSFT()


def store(cfg: SFTConfig) -> CheckpointStore:
    c = cfg.checkpoint
    return CheckpointStore(c.root, cfg.name, keep_last=c.keep_last, keep_every=c.keep_every,
                           storage_options=c.storage_options)


class SFTResources:
    """What an SFT process keeps between its phases: one trainer and one run's records (each kept while its
    config stays; another config replaces it). One per process (``PROCESS``)."""

    def __init__(self) -> None:
        self._trainer: tuple[str, TrainBackend] | None = None
        self._records: tuple[str, list[Record]] | None = None

    def trainer(self, cfg: SFTConfig) -> TrainBackend:
        key = f"{cfg.family}:{config_key(cfg.section)}:{config_key(cfg.train)}:{cfg.loop.seed}"
        if self._trainer is None or self._trainer[0] != key:
            self._trainer = None  # one trainer at a time: a model copy plus optimizer state
            self._trainer = (key, TrainBackend(fresh_bundle(cfg), algorithm(cfg), cfg.train))
        return self._trainer[1]

    def records(self, cfg: SFTConfig) -> list[Record]:
        key = config_key(cfg.data) + config_key(cfg.section)
        if self._records is None or self._records[0] != key:
            self._records = (key, load_records(cfg))
        return self._records[1]


PROCESS = SFTResources()
"""This process's SFT state (SFT runs in its task's process: it has no pool executor)."""


def trainer(cfg: SFTConfig) -> TrainBackend:
    """The process's backend (keyed by model/train/loss config); restore a version into it before training: it
    holds whatever the last chunk left."""
    return PROCESS.trainer(cfg)


def records(cfg: SFTConfig) -> list[Record]:
    """The run's records, read (or generated) once per process."""
    return PROCESS.records(cfg)


def step_batch(cfg: SFTConfig, policy, step: int, *, policy_version: int) -> SampleBatch:
    """Step ``step``'s supervised Parts; LM prompts are encoded as the RL trainside engine encodes them."""
    if cfg.family == "diffusion":
        return supervised_batch(cfg, records(cfg), step, policy_version=policy_version)
    from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine

    p = cfg.lm.prompt
    engine = TrainsideAREngine(policy, AREngineConfig(apply_chat_template=p.apply_chat_template,
                                                      system_prompt=p.system_prompt))
    eos = policy.tokenizer.eos_token_id
    return supervised_batch(cfg, records(cfg), step, policy_version=policy_version,
                            encode_prompt=engine.encode_prompt, tokenizer=policy.tokenizer, eos_id=eos)


# ----------------------------------------------------------------------------------- start / resume

def init_sft(cfg: SFTConfig, *, resume_from: str = "latest") -> CheckpointRef:
    """The version the run continues from: the published one (``latest``), or a fresh step-0 version of the
    untrained model when the run is empty; ``never`` demands an empty run. A resumed run must have the same
    family and model section (``ConfigError`` naming the key otherwise); other settings apply as given."""
    if resume_from not in ("latest", "never"):
        raise field_error(ConfigError, "resume", resume_from, "'latest' or 'never'",
                          "SFT resumes from the run's published version; fork by copying the run folder")
    st = store(cfg)
    ref = st.latest()
    if ref is not None:
        if resume_from == "never":
            raise field_error(ConfigError, "resume", "never", f"an empty run, but {st.uri} has step {ref.step}",
                              "pass resume='latest' or choose another run name")
        _check_same_model(cfg, ref)
        log.info("resuming SFT run %s from step %d", cfg.name, ref.step)
        return ref
    backend = TrainBackend(fresh_bundle(cfg), algorithm(cfg), cfg.train)
    return save_train_checkpoint(st, backend, config=to_dict(cfg), extra={"sft": True}, publish=True)


def _check_same_model(cfg: SFTConfig, ref: CheckpointRef) -> None:
    stored = load_version_json(ref, "config.json", storage_options=cfg.checkpoint.storage_options) or {}
    now = to_dict(cfg)
    for key in ("family", cfg.family):
        old, new = stored.get(key), now.get(key)
        if key == cfg.family and isinstance(old, dict):
            old, new = old.get("model"), new.get("model")
            key = f"{cfg.family}.model"
        if old != new:
            raise field_error(ConfigError, key, new, f"{old!r} as in {ref.uri}/config.json",
                              "resume with the model the run was trained with, or use another run name")


# ----------------------------------------------------------------------------------- train / publish

StepCallback = Callable[[int, dict], None]


def train_chunk(cfg: SFTConfig, ckpt: CheckpointRef, *, num_steps: int | None = None,
                on_step: StepCallback | None = None) -> tuple[CheckpointRef, list[dict]]:
    """Train steps ``ckpt.step + 1 ..`` (``num_steps``, default ``loop.steps_per_chunk``, never past
    ``loop.total_steps``) from version ``ckpt``; writes the chunk's last step as an unpublished version.

    Returns the new ref and one metrics dict per step (``sft/loss``, ``sft/grad_norm``, ``sft/lr``, loss
    metrics, ``time/step``). ``on_step(step, metrics)`` is called after every step."""
    n = cfg.loop.steps_per_chunk if num_steps is None else num_steps
    last = min(ckpt.step + n, cfg.loop.total_steps)
    if last <= ckpt.step:
        return ckpt, []
    backend = trainer(cfg)
    loaded = restore_train_checkpoint(backend, ckpt, storage_options=cfg.checkpoint.storage_options)
    history = []
    for step in range(ckpt.step + 1, last + 1):
        t0 = time.perf_counter()
        batch = step_batch(cfg, backend.policy, step, policy_version=backend.step_count)
        m = backend.step(batch)
        metrics = {"step": float(step), "sft/loss": m.loss, "sft/grad_norm": m.grad_norm, "sft/lr": m.lr}
        metrics.update({f"sft/{k}": float(v) for k, v in m.metrics.items()})
        metrics["time/step"] = time.perf_counter() - t0
        if not math.isfinite(m.loss):
            raise field_error(CheckpointError, "sft/loss", m.loss, "a finite loss", f"step {step} diverged; lower "
                              "train.lr (nothing of this chunk was written)")
        history.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    ref = save_train_checkpoint(store(cfg), backend, config=to_dict(cfg), extra=dict(loaded.extra), publish=False,
                                overwrite=True)
    return ref, history


def publish_sft(cfg: SFTConfig, ckpt: CheckpointRef) -> dict:
    """Make ``ckpt`` the run's published version (atomic pointer + retention)."""
    store(cfg).publish(ckpt)
    return {"uri": ckpt.uri, "step": ckpt.step, "policy_version": ckpt.policy_version}


# ----------------------------------------------------------------------------------- handoff to RL

def export_uri(cfg: SFTConfig) -> str:
    return f"{cfg.checkpoint.root.rstrip('/')}/{cfg.name}/{EXPORT_DIR}"


def export_model(cfg: SFTConfig, ckpt: CheckpointRef, uri: str | None = None) -> str:
    """Write version ``ckpt`` as a ``save_pretrained`` folder (diffusers pipeline / transformers model +
    tokenizer; LoRA merged) at ``uri`` (default ``<root>/<run>/export``), ``export.json`` last. Returns the URI.

    The RL loop starts from it with ``diffusion.model.source: <uri>`` (set ``max_sequence_length`` to the
    SFT model's, see the README) or ``lm.model.model: <uri>``. Remote URIs are written through fsspec."""
    uri = uri or export_uri(cfg)
    bundle = fresh_bundle(cfg)
    ema = cfg.loop.export_ema
    weights = load_weights(ckpt, storage_options=cfg.checkpoint.storage_options, ema=ema)
    apply_policy_weights(bundle, weights, where=ckpt.uri)
    marker = {"weights": "ema" if ema else "model", "run": cfg.name, "step": ckpt.step, "policy_version": ckpt.policy_version, "version_uri": ckpt.uri,
              "family": cfg.family, "model": to_dict(cfg.section.model)}
    if cfg.family == "diffusion":
        marker["max_sequence_length"] = bundle.max_sequence_length
    fmt = "diffusers" if cfg.family == "diffusion" else "transformers"
    write_export(bundle, fmt, uri, marker, storage_options=cfg.checkpoint.storage_options)
    log.info("exported step %d of %s to %s", ckpt.step, cfg.name, uri)
    return uri
