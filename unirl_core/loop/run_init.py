"""Where a run starts: a fresh step-0 version, a resumed one (its config changes checked) or a fork.

``init_run`` is the setup phase's library function (``tasks/setup.py``; ``run_local`` calls it first);
``loop.phases`` re-exports it beside the other phases.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os

import torch

from unirl_core.checkpoint import CheckpointRef, load_manifest, load_version_json, save_train_checkpoint
from unirl_core.checkpoint.store import EXTRA, TRAIN_STATE
from unirl_core.checkpoint.lease import RunLease
from unirl_core.config.loader import to_dict
from unirl_core.config.run import RunConfig, fork_point
from unirl_core.errors import CheckpointError, ConfigError, field_error
from unirl_core.loop import resume
from unirl_core.runtime import build
from unirl_core.train.backend import TrainBackend
from unirl_core.train.distributed import current_world

log = logging.getLogger(__name__)


def init_run(cfg: RunConfig, *, resume_from: str = "latest", fork_as: str | None = None) -> CheckpointRef:
    """The checkpoint the loop starts from.

    ``resume_from``: ``latest`` resumes the run's published version (or writes a fresh step-0
    version when the run has none), ``never`` requires an empty run, any other value names a version
    folder of this run (its URI, or a local path; relative paths are resolved against the current
    directory). A version older than the published one is refused: resuming there would retrain and
    overwrite the newer versions (fork it instead).

    The run's config is compared with the version's ``config.json`` (rules: ``unirl_core.loop.resume``):
    safe changes (``train.lr``, ``loop.total_steps``, ...) apply from the next step and are logged and
    recorded in ``<run>/history.json``; changes of the trajectory layout are refused unless forking;
    changes of the model are refused. A version at or past ``loop.total_steps`` is returned with a
    WARNING saying how to extend the run.

    ``fork_as``: start the new run ``fork_as`` at the version (its ``extra.json`` records the lineage:
    parent run, version URI and step, changed settings) and return the fork's version; the original run's
    versions are not touched (the fork's start version references their files and pins the parent's version,
    ``CheckpointStore.save_reference``). The loop then runs with ``resume.forked_config(cfg, fork_as)``. Calling
    it again with the same version continues the existing fork. ``checkpoint.fork_from: <run>@<step>`` in the
    config does the same for run ``cfg.name`` (then ``resume_from`` stays ``latest`` and ``fork_as`` unset).

    A vLLM run without ``lm.vllm.model`` also gets its step-0 policy exported as a HF folder
    (``build.export_initial_policy``) for the engine to start from.
    """
    if cfg.checkpoint.fork_from is not None:
        ref = _fork_from(cfg, resume_from, fork_as)
    else:
        ref = _start_point(cfg, resume_from, fork_as)
        if fork_as:
            cfg = resume.forked_config(cfg, fork_as)
    if ref is not None:
        if (note := resume.finished_message(cfg, ref)) is not None:
            resume.tell(note)
        if build.needs_initial_policy(cfg) and not build.initial_policy_exported(cfg):
            # The run began without it (e.g. trainside); the engine syncs ref's weights before its first
            # rollout anyway, so the step-0 weights of a fresh build serve as its start folder.
            build.export_initial_policy(cfg, build.fresh_bundle(cfg))
            gc.collect()  # that bundle's model, now garbage (see below)
        return ref
    return _fresh_start(cfg)


def _start_point(cfg: RunConfig, resume_from: str, fork_as: str | None) -> CheckpointRef | None:
    """The version a resume (or a ``fork_as`` fork) starts from: None for an empty run that starts fresh."""
    if fork_as:
        resume.check_fork_name(cfg, fork_as, resume_from)
    ref = _resume_point(cfg, resume_from, forking=bool(fork_as))
    if fork_as:
        if ref is None:
            raise field_error(ConfigError, "fork_as", fork_as, f"a version of run {cfg.name!r} to fork from",
                              f"{build.store(cfg).uri} holds none; train the run first, or fork another run "
                              "(name=<that run>)")
        parent_threads = apply_recorded_threads(cfg)
        return _fork(resume.forked_config(cfg, fork_as), ref, parent_threads)
    if ref is not None:
        apply_recorded_threads(cfg)
        _apply_config_changes(cfg, ref)
    return ref


def _fork_from(cfg: RunConfig, resume_from: str, fork_as: str | None) -> CheckpointRef:
    """The start of run ``cfg.name`` as a fork of ``checkpoint.fork_from`` (written now, or the fork's published
    version when it exists)."""
    if fork_as or resume_from != "latest":
        field, value = ("fork_as", fork_as) if fork_as else ("resume_from", resume_from)
        raise field_error(ConfigError, field, value, "left out with checkpoint.fork_from (it names the parent "
                          "version; name= names the fork)", f"drop {field}, or drop checkpoint.fork_from")
    run, step = fork_point(cfg.checkpoint.fork_from)
    if run == cfg.name:
        raise field_error(ConfigError, "checkpoint.fork_from", cfg.checkpoint.fork_from,
                          f"a version of another run than this one (name={cfg.name!r})",
                          f"name the fork, e.g. name={run}-b (the parent run stays untouched)")
    parent = resume.fork_version(cfg, run, step)
    parent_threads = apply_recorded_threads(dataclasses.replace(cfg, name=run))
    return _fork(cfg, parent, parent_threads)


def _fresh_start(cfg: RunConfig) -> CheckpointRef:
    """A fresh step-0 version of run ``cfg.name``."""
    # a fresh build: the cached bundle may carry another run's trained weights
    fresh = build.fresh_bundle(cfg)
    if build.needs_initial_policy(cfg):
        build.export_initial_policy(cfg, fresh)  # as built, before the backend makes fp32 master weights
    backend = TrainBackend(fresh, build.algorithm(cfg), cfg.train)
    ref = save_train_checkpoint(build.store(cfg), backend, config=to_dict(cfg), extra={}, publish=True)
    _record(build.store(cfg), {"event": "start", "utc": resume.utc_now(), "threads": threads_now()})
    # The model built for step 0 is pinned by a reference cycle: the first build of a process runs transformers'
    # lazy imports, whose frames (kept by a traceback in a cycle) chain back through f_back to the building
    # function's frame and its ``model`` local. Without a collection now its memory (a whole copy of the weights)
    # stays allocated until Python's next full collection. (On the H200 this was not qwen3-math's peak: that
    # was the step-1 restore's zero-gradient optimizer step, see TrainBackend._positional_optimizer_state.)
    del backend, fresh
    gc.collect()
    return ref


def run_lease(cfg: RunConfig) -> RunLease:
    """The single-writer lease of run ``cfg.name`` (``checkpoint.lease``): ``run_local`` keeps it for the whole run,
    the Flyte init task takes it and each publish task renews it (``unirl_core/checkpoint/lease.py``)."""
    return RunLease(cfg.checkpoint.root, cfg.name, cfg.checkpoint.lease,
                    storage_options=cfg.checkpoint.storage_options)


def _resume_point(cfg: RunConfig, resume_from: str, *, forking: bool = False) -> CheckpointRef | None:
    """The version ``resume_from`` names, or None when the run is empty and may start fresh. Unless
    ``forking``, a version the run has moved past is refused (``resume.check_no_newer``)."""
    store = build.store(cfg)
    if resume_from not in ("latest", "never"):
        ref = resume.find_version(store, resume_from, cfg.name)
    else:
        ref = store.latest()
        if ref is not None and resume_from == "never":
            raise field_error(ConfigError, "resume_from", "never", f"an empty run, but {store.uri} has step "
                              f"{ref.step}", "pass resume_from='latest' or choose another run name")
    if ref is not None:
        if not forking:
            resume.check_no_newer(store, ref, resume_from)
        log.info("%s run %s from step %d (%s)", "forking" if forking else "resuming", cfg.name, ref.step, ref.uri)
    return ref


def _apply_config_changes(cfg: RunConfig, ref: CheckpointRef) -> None:
    """Compare ``cfg`` with ``ref``'s config: raise for refused changes, log and record the applied ones."""
    stored = resume.stored_config(ref, cfg.checkpoint.storage_options)
    if stored is None:
        return
    applied = resume.check_changes(resume.config_changes(stored, resume.config_json(cfg)), ref=ref, forking=False)
    if not applied:
        return
    resume.tell(f"run {cfg.name!r} resumes from step {ref.step} with changed settings, applied from step "
                f"{ref.step + 1} on: {'; '.join(str(c) for c in applied)} (recorded in {build.store(cfg).uri}/"
                "history.json; the next version's config.json holds the new values)")
    _record(build.store(cfg), {"event": "resume", "utc": resume.utc_now(), "from": ref.uri, "step": ref.step,
                               "changes": {c.key: [c.old, c.new] for c in applied}})


def _record(store, event: dict) -> None:
    """Append ``event`` to the run's ``history.json``: rank 0 only in a multi-rank run (every rank runs
    ``init_run``; two writers of one file race)."""
    if current_world()[0] == 0:
        store.record(event)


def threads_now() -> dict[str, object]:
    """This process's CPU thread settings: torch's intra-op threads (what sets the order of a CPU float reduction,
    so a resume with another count is not bit-exact) and the variables that set them."""
    return {"torch": torch.get_num_threads(), **{k: os.environ.get(k) for k in resume.THREAD_VARIABLES}}


def apply_recorded_threads(cfg: RunConfig) -> dict[str, object] | None:
    """Set torch's thread count to the one run ``cfg.name`` started with (``<run>/history.json``), saying so at
    WARNING when it differs from this process's; returns the record (None for a run started before it was kept:
    nothing to apply). Applies to this process (``run_local``, a local execution); a cluster's task pods get their
    threads from their CPU resources."""
    recorded = next((e["threads"] for e in reversed(build.store(cfg).history())
                     if isinstance(e, dict) and isinstance(e.get("threads"), dict)), None)
    if recorded is None or not isinstance(recorded.get("torch"), int):
        return None
    now = torch.get_num_threads()
    if recorded["torch"] != now:
        torch.set_num_threads(recorded["torch"])
        resume.tell(f"run {cfg.name!r} trained with {recorded['torch']} torch thread(s) ("
                    + ", ".join(f"{k}={recorded.get(k)}" for k in resume.THREAD_VARIABLES)
                    + f"); this process had {now}: set to {recorded['torch']}, so the resumed steps add up floats "
                    "in the same order (bit-exact with an uninterrupted run)")
    return recorded


def _fork(cfg: RunConfig, parent: CheckpointRef, parent_threads: dict[str, object] | None = None) -> CheckpointRef:
    """Start run ``cfg.name`` at ``parent`` (a version of another run), with its lineage, referencing the parent's
    files; an existing fork of the same version is continued instead."""
    store = build.store(cfg)
    existing = store.latest()
    if existing is not None:
        recorded = resume.fork_parent(existing, cfg.checkpoint.storage_options)
        if recorded is None or resume.normalize_uri(recorded) != resume.normalize_uri(parent.uri):
            via_config = cfg.checkpoint.fork_from is not None  # else run_local's fork_as named the fork
            raise field_error(ConfigError, "name" if via_config else "fork_as", cfg.name, f"a new run name, but run "
                              f"{cfg.name!r} already has step {existing.step} ({store.uri}) and is not a fork of "
                              f"{parent.uri}", f"pick another fork name, or resume that run with name={cfg.name}"
                              + (" without checkpoint.fork_from" if via_config else ""))
        log.info("run %s is already a fork of %s; continuing it", cfg.name, parent.uri)
        ref = _resume_point(cfg, "latest")
        _apply_config_changes(cfg, ref)
        return ref
    opts = cfg.checkpoint.storage_options
    stored = resume.stored_config(parent, opts)
    changes = resume.config_changes(stored, resume.config_json(cfg)) if stored is not None else []
    applied = resume.check_changes(changes, ref=parent, forking=True)
    if TRAIN_STATE not in load_manifest(parent, storage_options=opts).files:
        raise field_error(CheckpointError, parent.uri, f"no {TRAIN_STATE}", "a training checkpoint to fork",
                          "fork a version written by the loop with its full state (optimizer, RNG, data cursor)")
    parent_extra = load_version_json(parent, EXTRA, storage_options=opts) or {}
    lineage = resume.lineage_record(parent, applied, parent_extra)
    # the fork's start version references the parent's files: nothing of the prefix is copied or recomputed
    ref = store.save_reference(parent, config=to_dict(cfg), extra={**parent_extra, "lineage": lineage})
    _record(store, {"event": "fork", "utc": lineage["forked_utc"], "from": parent.uri, "step": parent.step,
                    "changes": lineage["changes"], **({"threads": parent_threads} if parent_threads else {})})
    changed = f" with changed settings: {'; '.join(str(c) for c in applied)}" if applied else ""
    resume.tell(f"forked run {parent.run!r} at step {parent.step} ({parent.uri}) into run {cfg.name!r} ({ref.uri})"
                f"{changed}; run {parent.run!r} is untouched. Later sessions continue the fork with name={cfg.name} "
                "(resume 'latest').")
    return ref
