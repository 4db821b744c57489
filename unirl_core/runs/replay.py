"""Replay: rebuild step k of a finished (or running) run from what it stored, and check it bit for bit.

``replay(run, step=k)`` reads the recipe as it was for step k (version k's ``config.json``), version k-1 (weights,
optimizer, RNG, the advantage tracker) and the batch the run trained on at step k (``checkpoint.keep_batches``,
``<run>/batches/``). It runs the step again with the loop's own step function (``local.rl_step``: the step's
prompts and noise recipe come from the recipe and the step number, exactly as in the run) and checks that the
rollout batch, its rewards and advantages (``unirl_core.io.diff``) and version k (``unirl_core.checkpoint.diff``)
come out bitwise equal. A mismatch raises ``ReplayMismatch`` naming the first field that differs; a run that did
not store enough raises ``ReplayInputMissing`` naming what is missing and the setting that keeps it.

The replayed version is written under a scratch root (``<run>/replay/``, removed afterwards unless ``keep``), never
into the run; the run name stays the same, since it is part of what a step writes (the batch's metadata). It
runs in this process with the in-process executor whatever ``pool.execution`` the run used (the pool's results
are bitwise the in-process ones, ``tests/integration/test_pool.py``) and without the eval phase (it reads a
version; it does not change one). CLI: ``python -m unirl_core.runs replay <root>/<run> --step k``.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import time

import fsspec

from unirl_core.checkpoint import CheckpointRef, CheckpointStore, load_checkpoint, load_manifest, load_version_json
from unirl_core.checkpoint.batches import BatchStore
from unirl_core.checkpoint.diff import first_version_difference
from unirl_core.checkpoint.store import CONFIG, TRAIN_STATE
from unirl_core.config.loader import from_dict
from unirl_core.config.pool import PoolConfig
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, ConfigError, NumericsError, field_error
from unirl_core.io.diff import Difference, first_difference
from unirl_core.loop.executors import finish_writes
from unirl_core.loop.lagged import SyncRollouts
from unirl_core.loop.local import rl_step
from unirl_core.loop.run_init import apply_recorded_threads
from unirl_core.plugins import import_plugins

log = logging.getLogger(__name__)

LABELS = ("shard",)
"""Batch metadata that labels how a rollout was cut, not what it holds: ``run_local`` keeps the first shard's
``shard`` key on the step's batch (``SampleBatch.concat``), the Flyte join drops it (``loop.metrics.join_shards``)."""
SCRATCH = "replay"
"""Folder under the run where the replayed version is written (and removed afterwards)."""


class ReplayInputMissing(CheckpointError):
    """The run did not store something replay needs; the message says what and which setting keeps it."""


class ReplayMismatch(NumericsError):
    """The replayed step differs from the stored one; ``difference.field`` names the first field that does."""

    def __init__(self, message: str, difference: Difference) -> None:
        super().__init__(message)
        self.difference = difference


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayReport:
    """What a successful replay checked."""

    run: str
    step: int
    samples: int
    """Samples of the step's batch, compared field by field (rollout, rewards, advantages, metadata)."""
    version: str
    """URI of the stored version k that the replayed one equals (weights, EMA, train state, extra)."""
    seconds: float

    def summary(self) -> str:
        return (f"replay of step {self.step} of run {self.run!r}: bitwise equal - {self.samples} samples (rollout, "
                f"rewards, advantages) and version {self.step} ({self.version}); {self.seconds:.1f}s")


def split_run(run: str) -> tuple[str, str]:
    """``(checkpoint root, run name)`` of a run folder URL or path (``runs/tiny-flow-grpo``)."""
    trimmed = run.rstrip("/")
    root, name = posixpath.split(trimmed)
    if not name or not root:
        raise field_error(ConfigError, "run", run, "a run folder: <checkpoint.root>/<run name>",
                          "e.g. runs/tiny-flow-grpo or s3://bucket/ckpts/my-run")
    return root, name


def stored_run_config(ref: CheckpointRef, storage_options: dict | None = None) -> RunConfig:
    """The run config version ``ref`` was trained with (its ``config.json``), its plugins imported."""
    data = load_version_json(ref, CONFIG, storage_options=storage_options)
    if not isinstance(data, dict):
        raise ReplayInputMissing(f"{ref.uri}: no {CONFIG}; replay needs the recipe the step ran with (versions "
                                 "written by the loop carry it)")
    import_plugins(data.get("plugins") or [])
    return from_dict(RunConfig, data, f"{ref.uri}/{CONFIG}")


def _version(store: CheckpointStore, step: int, *, why: str) -> CheckpointRef:
    versions = store.versions()
    for ref in versions:
        if ref.step == step:
            return ref
    kept = [v.step for v in versions]
    if step > max(kept, default=0):
        raise field_error(ConfigError, "step", step, f"a step run {store.run!r} trained (its newest version is "
                          f"{max(kept, default=0)})", "pick a trained step")
    shown = ", ".join(map(str, kept[-12:])) + (" ..." if len(kept) > 12 else "")
    raise ReplayInputMissing(
        f"version {step} of run {store.run!r} ({store.uri}) is not kept ({why}); the run holds versions [{shown}]: "
        "retention pruned it. Train with checkpoint.keep_every=1 (every version kept; or a checkpoint.keep_last of "
        "at least loop.total_steps) to replay any step, or replay a step whose version and the one before are kept")


def replay_inputs(run: str, step: int, *, storage_options: dict | None = None):
    """What replaying ``step`` reads, each checked: (run config of step k, version k-1, version k, stored batch)."""
    root, name = split_run(run)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise field_error(ConfigError, "step", step, "a trained step >= 1", "step 0 is the starting version")
    store = CheckpointStore(root, name, storage_options=storage_options)
    if not store.versions():
        raise field_error(ConfigError, "run", run, "a run folder holding versions (an RL run: run_local or the grpo "
                          "workflow)", f"{store.uri} holds none; check the path (a composed run keeps its stacks in "
                          "sub-folders: replay it with python -m unirl_core.runs replay)")
    after = _version(store, step, why=f"the version step {step} wrote, compared with the replayed one")
    cfg = stored_run_config(after, storage_options)
    before = _version(store, step - 1, why=f"the version step {step} trains from")
    if TRAIN_STATE not in load_manifest(before, storage_options=storage_options).files:
        raise ReplayInputMissing(
            f"version {step - 1} of run {name!r} ({before.uri}) holds no full train state (optimizer, RNG): "
            f"checkpoint.every_n_steps={cfg.checkpoint.every_n_steps} writes it only every "
            f"{cfg.checkpoint.every_n_steps} steps. Replay a step right after one of those, or train with "
            "checkpoint.every_n_steps=1")
    lag = cfg.async_training.max_policy_lag
    if lag:
        raise field_error(ConfigError, "async_training.max_policy_lag", lag, "0 (a synchronous run) for replay",
                          "replay of lagged rollouts (the step samples with an older version, beside training) is "
                          "not implemented; replay a synchronous run")
    batches = BatchStore(root, name, storage_options=storage_options)
    if not batches.has(step):
        raise ReplayInputMissing(f"no stored batch of step {step} of run {name!r} ({batches.uri}): the run did not "
                                 "keep it (checkpoint.keep_batches was off when the step ran); train with "
                                 "checkpoint.keep_batches=true to keep every step's batch (rollout, rewards, "
                                 "advantages) for replay and re-scoring")
    stored = batches.load(step)
    return cfg, before, after, stored


def replay_config(cfg: RunConfig, scratch_root: str) -> RunConfig:
    """``cfg`` as replay runs it: versions written under ``scratch_root`` (same run name), no kept batches, the
    in-process executor, no eval, no metric sinks."""
    return dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, root=scratch_root, keep_batches=False),
        pool=PoolConfig(), eval=None,
        report=dataclasses.replace(cfg.report, tensorboard=False, wandb=None, progress=False))


def replay(run: str, *, step: int, storage_options: dict | None = None, keep: bool = False) -> ReplayReport:
    """Rebuild step ``step`` of ``run`` (``<checkpoint.root>/<run name>``, a path or URL) from what it stored and
    check it bit for bit; returns what was checked, raises ``ReplayMismatch`` (first differing field) or
    ``ReplayInputMissing`` (what the run did not store, and the setting that keeps it). ``keep``: leave the
    replayed version under ``<run>/replay/`` for inspection."""
    t0 = time.perf_counter()
    cfg, before, after, stored = replay_inputs(run, step, storage_options=storage_options)
    root, name = split_run(run)
    scratch_root = posixpath.join(root.rstrip("/"), name, SCRATCH)
    apply_recorded_threads(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, root=root)))
    rcfg = replay_config(dataclasses.replace(cfg, checkpoint=dataclasses.replace(
        cfg.checkpoint, storage_options=dict(storage_options or cfg.checkpoint.storage_options))), scratch_root)
    log.info("replaying step %d of run %s from %s", step, name, before.uri)
    rollouts = SyncRollouts(rcfg, before)
    try:
        _, batch, ref = rl_step(rcfg, before, step, rollouts)
        finish_writes()
        where = f"replay of step {step} of run {name!r}"
        if (diff := first_difference(stored, batch, ignore_metadata=LABELS)) is not None:
            raise ReplayMismatch(f"{where}: the batch differs first in field {diff.field!r}: {diff}", diff)
        opts = rcfg.checkpoint.storage_options
        got = load_checkpoint(ref, storage_options=opts)
        if (diff := first_version_difference(load_checkpoint(after, storage_options=opts), got)) is not None:
            raise ReplayMismatch(f"{where}: the batch is bitwise equal, but version {step} differs first in "
                                 f"{diff}", diff)
    finally:
        rollouts.close()
        try:  # a step that failed mid-way may leave a version in flight: it lands (or fails) before the removal
            finish_writes()
        except Exception as e:  # noqa: BLE001  (the step's own error is the one raised)
            log.error("the replayed version's background write failed: %s", e)
        if not keep:
            fs, path = fsspec.core.url_to_fs(scratch_root, **dict(rcfg.checkpoint.storage_options))
            if fs.exists(path):
                fs.rm(path, recursive=True)
    report = ReplayReport(run=name, step=step, samples=len(stored), version=after.uri,
                          seconds=time.perf_counter() - t0)
    log.info("%s", report.summary())
    return report
