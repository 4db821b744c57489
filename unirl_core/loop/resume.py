"""Where a run starts: which version a ``resume_from`` names, what the config may change against that
version (:data:`RESUME_RULES`: ``apply`` from the next step, ``fork`` only into a new run, ``never``; a key falls
under its longest listed prefix, an unlisted one is ``fork``), forks into a new run name, and the messages a user
gets when there is nothing to do or the run is interrupted. The rules, as a table: ``docs/concepts.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Literal

import fsspec

from unirl_core.checkpoint import CheckpointRef, CheckpointStore, load_manifest, load_version_json
from unirl_core.checkpoint.store import CONFIG, EXTRA, TRAIN_STATE
from unirl_core.config.loader import to_dict
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, ConfigError, field_error

log = logging.getLogger(__name__)

Rule = Literal["ignore", "apply", "fork", "never"]

RESUME_RULES: dict[str, Rule] = {
    # where the run lives, not what it trains
    "name": "ignore", "checkpoint.root": "ignore", "checkpoint.storage_options": "ignore",
    "checkpoint": "apply",  # keep_last, keep_every
    "checkpoint.fork_from": "ignore",  # where a fork started, not what it trains
    "loop": "apply",  # total_steps, steps_per_chunk, rollout_shards, seed
    "eval": "apply",  # held-out evaluation: when, which weights, which prompts (never changes training)
    "async_training": "apply",  # the lag applies from the next step's rollout on
    "train": "apply",  # lr, betas, eps, weight_decay, schedule, warmup, clipping, updates per batch, sharding
    "train.micro_batch_size": "fork",
    "train.micro_batch_tokens": "fork",
    "train.weights_scope": "never",
    "train.ema_decay": "never",
    "train.seed": "never",
    "reward": "apply",
    "advantage": "apply",
    "tracker": "fork",
    "data": "fork",
    "family": "never",
    "diffusion.model": "never",
    "diffusion.model.device": "apply",
    "diffusion.model.gradient_checkpointing": "apply",
    "diffusion.model.cuda_graphs": "apply",  # the same kernels as eager, replayed
    "diffusion.model.cfg_batch": "fork",  # the forward layout of rollout and replay: a trajectory-numerics change
    "diffusion.sampling": "fork",
    "diffusion.engine": "fork",
    "diffusion.engine.decode_media": "apply",
    "diffusion.algorithm": "apply",
    "lm.model": "never",
    "lm.model.attn_implementation": "apply",
    "lm.model.logprob_chunk_tokens": "apply",  # recording and replay read it together, from the next step on
    "lm.model.device": "apply",
    "lm.sampling": "fork",
    "lm.engine": "fork",
    "lm.engine.decoder": "apply",
    "lm.engine.decode_batch_size": "apply",
    "lm.engine.cuda_graphs": "apply",  # like the decode width: which draws a row gets, never the recorded log-probs
    "lm.engine.stop_check_interval": "apply",
    "lm.engine.finish_check_interval": "apply",
    "lm.algorithm": "apply",
    "filter_groups": "apply",  # which rewarded groups are trained, not the trajectory layout
    "lm.deployment": "apply",
    "lm.vllm": "apply",
    "lm.sglang": "apply",
    "lm.dedicated_engine": "apply",
    "lm.logp_check": "apply",
    "lm.agent": "fork",  # the environment and turn limits shape every trajectory
    "pool": "apply",  # where the phases execute, not what they compute
    "report": "ignore",  # what the run shows (TensorBoard scalars, progress lines), not what it trains
    "plugins": "apply",  # which modules register parts; what the run uses of them is named by the other keys
}
"""Dotted config prefix -> what a resume may do when the value differs from the version's config."""

_WHY_NEVER = {
    "train.seed": "a resumed or forked run restores the RNG state saved in the version; train.seed only seeds a "
                  "run's fresh step-0 backend",
    "train.ema_decay": "the version's EMA state (or its absence) is restored as saved",
}
_WHY_NEVER_DEFAULT = "the version's weights and optimizer state belong to the old model / adapter layout"


def rule_for(key: str) -> Rule:
    """The rule of a dotted config key: its longest prefix in :data:`RESUME_RULES`, else ``fork``."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        rule = RESUME_RULES.get(".".join(parts[:n]))
        if rule is not None:
            return rule
    return "fork"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigChange:
    """One config value that differs from the version's ``config.json``."""

    key: str
    """Dotted path, e.g. ``train.lr``."""
    old: object
    """The version's value (JSON data)."""
    new: object
    """This run's value (JSON data)."""

    @property
    def rule(self) -> Rule:
        return rule_for(self.key)

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def config_json(cfg: RunConfig) -> dict:
    """``to_dict(cfg)`` as it reads back from a version's config.json (tuples become lists)."""
    return json.loads(json.dumps(to_dict(cfg), sort_keys=True, allow_nan=False))


def config_changes(stored: dict, current: dict, prefix: str = "") -> list[ConfigChange]:
    """Every leaf that differs, ``ignore`` keys left out. A key only one side has (a field added or removed
    by another version of the code) is skipped: there is nothing to compare it with."""
    out: list[ConfigChange] = []
    for key in sorted(set(stored) & set(current)):
        path = f"{prefix}{key}"
        if rule_for(path) == "ignore":
            continue
        old, new = stored[key], current[key]
        if isinstance(old, dict) and isinstance(new, dict):
            out.extend(config_changes(old, new, f"{path}."))
        elif old != new:
            out.append(ConfigChange(key=path, old=old, new=new))
    for key in sorted(set(stored) ^ set(current)):
        log.debug("config key %s%s is in only one of the version's and the run's config; not compared", prefix, key)
    return out


def check_changes(changes: Sequence[ConfigChange], *, ref: CheckpointRef, forking: bool) -> list[ConfigChange]:
    """Raise ``ConfigError`` for the first refused change (naming the key, both values and the fix, and listing
    the other refused keys); return the changes, all of which then apply."""
    refused = [c for c in changes if c.rule == "never" or (c.rule == "fork" and not forking)]
    if refused:
        first = refused[0]
        others = f" (also changed and refused: {', '.join(str(c) for c in refused[1:])})" if refused[1:] else ""
        where = f"{first.old!r}, the value of {ref.uri}/{CONFIG}"
        if first.rule == "never":
            why = _WHY_NEVER.get(first.key, _WHY_NEVER_DEFAULT)
            raise field_error(ConfigError, first.key, first.new, f"{where}{others}",
                              f"{why}: keep {first.key}={first.old!r} to resume or fork run {ref.run!r} from step "
                              f"{ref.step}, or train the new value as a new run from scratch (another name, "
                              f"resume_from='latest')")
        raise field_error(ConfigError, first.key, first.new, f"{where}{others}",
                          f"it changes what a step samples or how its batch is cut, and one run keeps one layout: "
                          f"keep {first.key}={first.old!r} to resume run {ref.run!r}, or start a new run from this "
                          f"version with fork_as='<new name>' (pyflyte: --fork_as <new name>), or train from "
                          f"scratch under another name")
    return list(changes)


# ------------------------------------------------------------------------------------- which version


def normalize_uri(uri: str) -> str:
    """Comparable form of a version URI: object-store URLs as given (no trailing '/'); local paths (plain,
    relative, ``~``, ``file://``) absolute, symlinks resolved."""
    if "://" in uri and not uri.startswith("file://"):
        return uri.rstrip("/")
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return os.path.realpath(os.path.expanduser(path))


def find_version(store: CheckpointStore, resume_from: str, run: str) -> CheckpointRef:
    """The complete version of ``store`` that ``resume_from`` names: a URI, or a local path (relative to the
    current directory, trailing '/' allowed). ``CheckpointError`` naming the run's newest versions otherwise."""
    want = normalize_uri(resume_from)
    versions = store.versions()
    for ref in versions:
        if normalize_uri(ref.uri) == want:
            return ref
    newest = [r.uri for r in versions][-3:]
    raise field_error(CheckpointError, "resume_from", resume_from,
                      f"a complete version of run {run!r} under {store.uri} (resolved: {want})",
                      f"pick one of its versions (newest: {newest}) or 'latest'; a version of another run: set "
                      f"name=<that run> and fork_as=<new name>")


def check_no_newer(store: CheckpointStore, ref: CheckpointRef, resume_from: str) -> None:
    """Refuse to resume from ``ref`` when the run has moved past it: the steps after it would be retrained and
    their versions overwritten. The one exception is a crash leftover: version ``ref.step + 1`` written but
    never published while ``ref`` is the published version (it is replaced, as documented)."""
    newer = [r for r in store.versions() if r.step > ref.step]
    if not newer:
        return
    published = store.latest()
    leftover = (len(newer) == 1 and newer[0].step == ref.step + 1 and published is not None
                and published.step <= ref.step)
    if leftover:
        log.info("version %s was written but never published (an interrupted step); it will be replaced",
                 newer[0].uri)
        return
    steps = [r.step for r in newer]
    raise field_error(ConfigError, "resume_from", resume_from,
                      f"the run's newest version, but run {ref.run!r} already has steps {steps} after step "
                      f"{ref.step} (published: step {published.step if published else None}); resuming here would "
                      f"retrain them and overwrite {[r.uri for r in newer]}",
                      f"resume from 'latest', or start a new run from step {ref.step} with fork_as='<new name>' "
                      f"(pyflyte: --fork_as <new name>), which leaves run {ref.run!r} untouched")


# ------------------------------------------------------------------------------------- forks


def forked_config(cfg: RunConfig, fork_as: str | None) -> RunConfig:
    """The config the loop runs with after ``init_run(cfg, fork_as=...)``: the same, under the fork's name."""
    return dataclasses.replace(cfg, name=fork_as) if fork_as else cfg


def fork_version(cfg: RunConfig, run: str, step: int) -> CheckpointRef:
    """Version ``step`` of run ``run`` under ``cfg``'s checkpoint root, the point ``checkpoint.fork_from`` names: a
    complete version with the full state. ``CheckpointError`` naming the field, the value and the fix otherwise."""
    value, opts = cfg.checkpoint.fork_from, cfg.checkpoint.storage_options
    store = CheckpointStore(cfg.checkpoint.root, run, storage_options=opts)
    versions = store.versions()
    if not versions:
        fs, root = fsspec.core.url_to_fs(cfg.checkpoint.root, **opts)
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) if fs.exists(root) else ()
        runs = sorted(n for n in names if not n.startswith("."))
        raise field_error(CheckpointError, "checkpoint.fork_from", value,
                          f"a run with versions under checkpoint.root={cfg.checkpoint.root!r}",
                          f"{store.uri} holds none; name one of the runs there ({runs}) or train run {run!r} first")
    ref = next((r for r in versions if r.step == step), None)
    if ref is None:
        raise field_error(CheckpointError, "checkpoint.fork_from", value,
                          f"a stored step of run {run!r}: one of {[r.step for r in versions]}",
                          f"fork one of those steps; to fork any step, train the parent with checkpoint.keep_every=1")
    if TRAIN_STATE not in load_manifest(ref, storage_options=opts).files:
        stored = load_version_json(ref, CONFIG, storage_options=opts) or {}
        if (stored.get("checkpoint") or {}).get("full_state") == "sharded":
            raise field_error(CheckpointError, "checkpoint.fork_from", value, "a version with its full state in "
                              f"{TRAIN_STATE}, but run {run!r} keeps it sharded (checkpoint.full_state: sharded, "
                              "state-XXXXXXXX/)", "forks start from file full states: train the parent with "
                              "checkpoint.full_state=file to fork it")
        full = [r.step for r in versions if TRAIN_STATE in load_manifest(r, storage_options=opts).files]
        raise field_error(CheckpointError, "checkpoint.fork_from", value,
                          f"a version with the full state (optimizer, RNG, data cursor), but {ref.uri} holds "
                          "weights only (checkpoint.every_n_steps > 1)",
                          f"fork one of steps {full}, or train the parent with checkpoint.every_n_steps=1")
    return ref


def check_fork_name(cfg: RunConfig, fork_as: str, resume_from: str) -> None:
    if fork_as == cfg.name or "/" in fork_as or fork_as in (".", ".."):
        raise field_error(ConfigError, "fork_as", fork_as, f"a new run name without '/', not {cfg.name!r}",
                          "name the fork, e.g. fork_as='" + cfg.name + "-b'")
    if resume_from == "never":
        raise field_error(ConfigError, "resume_from", resume_from, "'latest' or a version URI with fork_as",
                          "a fork starts from a version of the run; pass the version to fork from")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def lineage_record(parent: CheckpointRef, changes: Sequence[ConfigChange], parent_extra: dict) -> dict:
    """What a fork's versions carry in ``extra.json`` under ``lineage`` (train_phase copies extra forward)."""
    return {"parent_run": parent.run, "parent_uri": parent.uri, "parent_step": parent.step,
            "parent_policy_version": parent.policy_version,
            "forked_utc": utc_now(),
            "changes": {c.key: [c.old, c.new] for c in changes},
            "parent_lineage": parent_extra.get("lineage")}


def stored_config(ref: CheckpointRef, storage_options: dict) -> dict | None:
    """The config ``ref`` was trained with (its ``config.json``); None, said at WARNING, when it has none."""
    stored = load_version_json(ref, CONFIG, storage_options=storage_options)
    if not isinstance(stored, dict):
        tell(f"version {ref.uri} has no {CONFIG}: the run's config cannot be compared with the one it was "
             "trained with; every setting is taken from the run's config as given")
        return None
    return stored


def fork_parent(ref: CheckpointRef, storage_options: dict) -> str | None:
    """The ``parent_uri`` recorded in ``ref``'s lineage, None when ``ref`` is not a fork."""
    extra = load_version_json(ref, EXTRA, storage_options=storage_options) or {}
    lineage = extra.get("lineage") if isinstance(extra, dict) else None
    return lineage.get("parent_uri") if isinstance(lineage, dict) else None


# ------------------------------------------------------------------------------------- telling the user


def tell(message: str) -> None:
    """WARNING on this module's logger, and on stderr: printed there unless logging already writes it to stderr
    (a stderr handler, or no handler at all, when Python's last-resort handler does)."""
    log.warning(message)
    if not _logged_to_stderr(log):
        print(message, file=sys.stderr, flush=True)


def _logged_to_stderr(logger: logging.Logger) -> bool:
    found = False
    node: logging.Logger | None = logger
    while node is not None:
        for h in node.handlers:
            found = True
            if (isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr, sys.__stderr__)
                    and h.level <= logging.WARNING):
                return True
        node = node.parent if node.propagate else None
    return not found and logging.lastResort is not None


def finished_message(cfg: RunConfig, ref: CheckpointRef) -> str | None:
    """What to say when ``ref`` already reaches ``loop.total_steps`` (None while steps remain)."""
    total = cfg.loop.total_steps
    if ref.step < total:
        return None
    more = ref.step + total
    return (f"run {cfg.name!r} is already complete: its published version {ref.uri} is at step {ref.step} and "
            f"loop.total_steps={total}, so there is nothing to train. To train it further, raise loop.total_steps "
            f"above {ref.step} and keep the run's other overrides (pyflyte: --overrides "
            f"'[..., \"loop.total_steps={more}\"]'; library: load_recipe(..., [..., 'loop.total_steps={more}'])); "
            f"to train again from scratch, use another run name (name=<new name>).")


def ended_message(cfg: RunConfig, step: int, *, decks: bool = False) -> str:
    """Where a run that reached step ``step`` left what it wrote: report, versions, TensorBoard scalars."""
    run = f"{cfg.checkpoint.root.rstrip('/')}/{cfg.name}"
    lines = [f"run {cfg.name!r} reached step {step} of {cfg.loop.total_steps}:",
             f"  report:      {run}/report/index.html (charts, every step's samples and phase pages)",
             f"  checkpoints: {run}/step-XXXXXXXX (LATEST names the published one, where a resume continues)"]
    if cfg.report.tensorboard:
        lines.append(f"  TensorBoard: tensorboard --logdir {run}/tensorboard")
    if decks:
        lines.append("  Flyte decks: the same phase pages, in the report's step folders (a local execution keeps "
                     "flytekit's own copies in its temp folders)")
    return "\n".join(lines)


def interrupted_message(cfg: RunConfig, resume_command: str) -> str:
    """What was published last in ``cfg``'s run and the command that continues it."""
    try:
        ref = CheckpointStore(cfg.checkpoint.root, cfg.name,
                              storage_options=cfg.checkpoint.storage_options).latest()
    except Exception as e:  # noqa: BLE001 - an interrupt message must never hide the interrupt
        return f"interrupted: run {cfg.name!r}; could not read its store ({e}). Resume with: {resume_command}"
    if ref is None:
        return f"interrupted: run {cfg.name!r} has no published version yet; start it again with: {resume_command}"
    return (f"interrupted: run {cfg.name!r} last published step {ref.step} ({ref.uri}); steps after it are "
            f"redone on resume. Resume with: {resume_command}")


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""The environment variables that set a process's CPU threads (recorded with a run, repeated by its resume line)."""


def library_resume_command(cfg: RunConfig, resume_from: str, fork_as: str | None) -> str:
    """The ``run_local`` call that continues a run (a fork: the same call, which continues the fork)."""
    if fork_as:
        return f"run_local(cfg, resume_from={resume_from!r}, fork_as={fork_as!r}) with the same cfg"
    return f"run_local(cfg) with the same cfg (name={cfg.name!r}; resume_from='latest' is the default)"
