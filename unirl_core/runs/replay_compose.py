"""Replay a step of a composed run bit for bit (the composed counterpart of ``unirl_core.runs.replay``).

A composed run keeps its stacks' versions in ``<run>/enhancer/`` and ``<run>/image/`` and, with
``checkpoint.keep_batches``, each step's scored batch and the composed recipe it ran with
(``<run>/batches/step-XXXXXXXX.{arrow,config.json}``). ``replay_compose(run, step=k)`` reruns step k with the compose
loop's own step function (``local.compose_step``) from each trained stack's version k-1 (a frozen stack: its
step-0 version), writing under ``<run>/replay/`` (removed afterwards), and checks that the batch (both Parts: the
rewrite and the image, rewards, advantages) and every trained stack's version k come out bitwise equal; a mismatch
raises ``ReplayMismatch`` naming the first field that differs.

CLI: ``python -m unirl_core.runs replay <root>/<run> --step k``.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import time

import fsspec

from unirl_core.checkpoint import CheckpointRef, CheckpointStore, load_checkpoint, load_manifest
from unirl_core.checkpoint.batches import BatchStore
from unirl_core.checkpoint.diff import first_version_difference
from unirl_core.checkpoint.store import TRAIN_STATE
from unirl_core.compose.config import ENHANCER_REFERENCE, STACKS, ComposeRunConfig
from unirl_core.compose.local import compose_step
from unirl_core.config.loader import from_dict
from unirl_core.errors import ConfigError, field_error
from unirl_core.io.diff import first_difference
from unirl_core.loop.executors import finish_writes
from unirl_core.runs.replay import LABELS, SCRATCH, ReplayInputMissing, ReplayMismatch, ReplayReport, split_run
from unirl_core.plugins import import_plugins

log = logging.getLogger(__name__)


def is_composed_run(run: str, *, storage_options: dict | None = None) -> bool:
    """Whether ``run`` is a composed run's folder: no versions of its own, a trained or frozen stack's under it."""
    root, name = split_run(run)
    if CheckpointStore(root, name, storage_options=storage_options).versions():
        return False
    run_root = posixpath.join(root.rstrip("/"), name)
    return any(CheckpointStore(run_root, s, storage_options=storage_options).versions() for s in STACKS)


def _version(store: CheckpointStore, step: int, stack: str) -> CheckpointRef:
    for ref in store.versions():
        if ref.step == step:
            return ref
    kept = [v.step for v in store.versions()]
    raise ReplayInputMissing(f"version {step} of the {stack} stack ({store.uri}) is not kept (it holds {kept}): "
                             "retention pruned it; train with checkpoint.keep_every=1 to replay any step")


def compose_inputs(run: str, step: int, *, storage_options: dict | None = None):
    """(composed recipe of step k, stack refs before, trained stacks' versions k, stored batch), each checked."""
    root, name = split_run(run)
    batches = BatchStore(root, name, storage_options=storage_options)
    if not batches.has(step):
        raise ReplayInputMissing(f"no stored batch of step {step} of composed run {name!r} ({batches.uri}): train "
                                 "with checkpoint.keep_batches=true to keep every step's batch and recipe")
    data = batches.config(step)
    if data is None:
        raise ReplayInputMissing(f"step {step} of composed run {name!r} was stored without its recipe "
                                 f"({batches.uri}); batches kept by this version of the library carry it")
    import_plugins(data.get("plugins") or [])
    cfg = from_dict(ComposeRunConfig, data, f"{batches.uri} step {step} config")
    run_root = posixpath.join(root.rstrip("/"), name)
    before, after = {}, {}
    for stack in STACKS:
        store = CheckpointStore(run_root, stack, storage_options=storage_options)
        if stack in cfg.trained:
            before[stack] = _version(store, step - 1, stack)
            after[stack] = _version(store, step, stack)
            if TRAIN_STATE not in load_manifest(before[stack], storage_options=storage_options).files:
                raise ReplayInputMissing(f"version {step - 1} of the {stack} stack holds no full train state; "
                                         "train with checkpoint.every_n_steps=1")
        else:
            before[stack] = _version(store, 0, stack)
    return cfg, before, after, batches.load(step)


def replay_compose(run: str, *, step: int, storage_options: dict | None = None, keep: bool = False) -> ReplayReport:
    """Rebuild step ``step`` of the composed run ``run`` and check it bit for bit (see the module docstring)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise field_error(ConfigError, "step", step, "a trained step >= 1", "step 0 is the starting version")
    t0 = time.perf_counter()
    cfg, before, after, stored = compose_inputs(run, step, storage_options=storage_options)
    root, name = split_run(run)
    scratch = posixpath.join(root.rstrip("/"), name, SCRATCH)
    opts = dict(storage_options or cfg.checkpoint.storage_options)
    pool = next(f for f in dataclasses.fields(ComposeRunConfig) if f.name == "pool").default_factory()
    rcfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, root=scratch, keep_batches=False,
                                                                   storage_options=opts),
                               eval=None, pool=pool,
                               report=dataclasses.replace(cfg.report, tensorboard=False, wandb=None, progress=False))
    fs, path = fsspec.core.url_to_fs(scratch, **opts)
    reference = posixpath.join(root.rstrip("/"), name, ENHANCER_REFERENCE)
    ref_fs, ref_path = fsspec.core.url_to_fs(reference, **opts)
    if ref_fs.exists(ref_path):  # the enhancer's KL reference lives beside the stacks, where the config points
        fs.makedirs(posixpath.join(path, name), exist_ok=True)
        ref_fs.copy(ref_path, posixpath.join(path, name, ENHANCER_REFERENCE), recursive=True)
    try:
        refs, batch, _ = compose_step(rcfg, dict(before), step)
        finish_writes()
        where = f"replay of step {step} of composed run {name!r}"
        if (diff := first_difference(stored, batch, ignore_metadata=LABELS)) is not None:
            raise ReplayMismatch(f"{where}: the batch differs first in field {diff.field!r}: {diff}", diff)
        for stack in cfg.trained:
            got = load_checkpoint(refs[stack], storage_options=opts)
            if (diff := first_version_difference(load_checkpoint(after[stack], storage_options=opts), got)) is not None:
                raise ReplayMismatch(f"{where}: the batch is bitwise equal, but the {stack} stack's version {step} "
                                     f"differs first in {diff}", diff)
    finally:
        try:
            finish_writes()
        except Exception as e:  # noqa: BLE001  (the step's own error is the one raised)
            log.error("the replayed version's background write failed: %s", e)
        if not keep and fs.exists(path):
            fs.rm(path, recursive=True)
    report = ReplayReport(run=name, step=step, samples=len(stored),
                          version=", ".join(after[s].uri for s in cfg.trained), seconds=time.perf_counter() - t0)
    log.info("%s", report.summary())
    return report
