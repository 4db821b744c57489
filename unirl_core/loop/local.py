"""The loop in plain Python: the same phase functions the Flyte tasks call, chained in-process.

It is the baseline of the orchestration benchmark and the quickest way to debug a recipe.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable

from unirl_core.checkpoint import CheckpointRef
from unirl_core.checkpoint.lease import RunLease
from unirl_core.config.preflight import preflight
from unirl_core.config.run import RunConfig
from unirl_core.loop import resume
from unirl_core.loop.evaluate import eval_phase
from unirl_core.loop.lagged import RolloutSource, rollout_source
from unirl_core.loop.metrics import merge_shard_metrics
from unirl_core.loop.run_init import run_lease
from unirl_core.loop.phases import (
    advantage_phase,
    dynamic_sampling_phase,
    finish_writes,
    init_run,
    publish_phase,
    reward_phase,
    train_phase,
)
from unirl_core.report.run_report import RunReport
from unirl_core.report.tensorboard import ScalarLog
from unirl_core.report.mlflow_log import MlflowLog
from unirl_core.report.wandb_log import MetricSinks, WandbLog
from unirl_core.config.run import ReportConfig
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

StepCallback = Callable[[dict, SampleBatch], None]


def progress_line(step: int, total: int, metrics: dict, step_seconds: float, eta_seconds: float) -> str:
    """``step k/N | reward mean | ratio | [eval] | step time | ETA`` - one line per step (no ratio for a loss
    without one, e.g. DiffusionNFT; the eval reward on the steps that evaluate)."""
    reward = metrics.get("reward/mean", metrics.get("advantage/reward_mean", math.nan))
    ratio = metrics.get("train/ratio_mean", math.nan)
    line = f"step {step}/{total} | reward {reward:.4f} | "
    if not math.isnan(ratio):
        line += f"ratio {ratio:.4f} | "
    if "eval/reward/mean" in metrics:
        line += f"eval {metrics['eval/reward/mean']:.4f} | "
    return line + f"step {step_seconds:.1f}s | ETA {eta_seconds:.0f}s"


def run_local(cfg: RunConfig, *, resume_from: str = "latest", fork_as: str | None = None,
              on_step: StepCallback | None = None, progress: bool | None = None) -> list[dict]:
    """Run ``cfg.loop.total_steps`` (from the resume point) in this process; returns per-step metrics,
    each with ``time/<phase>`` seconds spent inside phase compute.

    ``resume_from`` / ``fork_as``: as in ``init_run`` (with ``fork_as`` the steps train the new run).
    ``progress``: print each step's progress line (the one the Flyte report task logs) and, once, what the
    long phases of the first step do (model build, checkpoint restore, engine start) to stderr; None follows
    ``cfg.report.progress``. Either way they are logged at INFO on this module's logger.
    With ``cfg.report.tensorboard`` every step's metrics also go to ``<checkpoint.root>/<run>/tensorboard``,
    with ``cfg.report.wandb`` to a W&B run (id: the run name, resumed by a resumed run).
    Ctrl-C: says at WARNING and on stderr which version was published last and the call that resumes,
    then re-raises the KeyboardInterrupt."""
    show = cfg.report.progress if progress is None else progress
    # The setup task's preflight, here too: a placeholder or unwritable checkpoint root, or an unreachable
    # model, fails now naming the field - not as a storage/hub error after the model build. Once per run: under
    # torchrun only rank 0 probes (a probe removes the run folder it created, under another rank's write).
    if os.environ.get("RANK", "0") == "0":
        for note in preflight(cfg):
            say(f"preflight: {note}", show)
    try:
        # one writer per run: rank 0 holds the run's lease (the forked run's, when forking) until the run ends
        with (run_lease(resume.forked_config(cfg, fork_as)).kept() if os.environ.get("RANK", "0") == "0"
              else contextlib.nullcontext()) as lease:
            fork_from = cfg.checkpoint.fork_from
            say(f"run {cfg.name}: opening it (resume_from={resume_from!r}"
                f"{f', fork_as={fork_as!r}' if fork_as else ''}"
                + (f"; an empty run starts at version {fork_from} (checkpoint.fork_from)) ..." if fork_from else
                   f"; an empty run builds model {_model_name(cfg)} for its step-0 version) ..."), show)
            ckpt = init_run(cfg, resume_from=resume_from, fork_as=fork_as)
            return _run_steps(resume.forked_config(cfg, fork_as), ckpt, _checking_lease(on_step, lease), show)
    except KeyboardInterrupt:
        resume.tell(resume.interrupted_message(resume.forked_config(cfg, fork_as),
                                               resume.library_resume_command(cfg, resume_from, fork_as)))
        raise


def _checking_lease(on_step: StepCallback | None, lease: RunLease | None) -> StepCallback | None:
    """``on_step`` preceded by the lease's check: a run whose lease was taken over stops after the step."""
    if lease is None:
        return on_step

    def checked(metrics: dict, batch: SampleBatch) -> None:
        lease.check()
        if on_step is not None:
            on_step(metrics, batch)
    return checked


def say(message: str, show: bool) -> None:
    """INFO on this module's logger, and a line on stderr when ``show``."""
    log.info(message)
    if show:
        print(message, file=sys.stderr, flush=True)


def open_sinks(report: ReportConfig, run_uri: str, name: str, *, storage_options: dict,
               run_config: dict) -> MetricSinks:
    """The per-step metric sinks ``report`` asks for: TensorBoard scalars under ``<run_uri>/tensorboard``, a W&B
    run (id: the run name, so a resumed run continues it), an MLflow run (tagged with the run name, likewise)."""
    tb = wb = ml = None
    if report.tensorboard:
        tb = ScalarLog(run_uri, storage_options=storage_options)
        log.info("TensorBoard scalars: tensorboard --logdir %s", tb.uri)
    if report.wandb is not None:
        try:
            wb = WandbLog(report.wandb, name, run_config=run_config)
        except BaseException:
            if tb is not None:
                tb.close()
            raise
        log.info("W&B run %s (%s)", wb.run_id, wb.url or wb.mode)
    if report.mlflow is not None:
        try:
            ml = MlflowLog(report.mlflow, name, run_config=run_config)
        except BaseException:
            MetricSinks(tb, wb).close()
            raise
        log.info("MLflow run %s (experiment %s)", ml.run_id, ml.experiment_id)
    return MetricSinks(tb, wb, ml)


def timed(times: dict[str, float], metrics: dict, name: str, phase: Callable, *args, **kwargs):
    """``phase(*args, **kwargs)``, which returns (output, metrics): its metrics go into ``metrics``, its seconds
    into ``times[name]``; returns the output."""
    t0 = time.perf_counter()
    out, m = phase(*args, **kwargs)
    metrics.update(m)
    times[name] = time.perf_counter() - t0
    return out


def _model_name(cfg: RunConfig) -> str:
    model = cfg.section.model
    return str(getattr(model, "model", None) or getattr(model, "source", "?"))


def first_step_notes(cfg: RunConfig, ckpt: CheckpointRef) -> list[str]:
    """What the first step of this process spends long on before its own work: one line per phase setup."""
    if ckpt.step >= cfg.loop.total_steps:
        return []
    notes = []
    if cfg.pool.execution == "pool":
        notes.append("starting the Ray pool's actors (engine, reward, trainer; each builds its model) ...")
    else:
        notes.append(f"building model {_model_name(cfg)} (rollout copy and trainer copy, once per process) ...")
        notes.append(f"restoring checkpoint step {ckpt.step} ({ckpt.uri}) into the rollout model and the trainer "
                     "...")
    if cfg.family == "lm" and cfg.lm.dedicated is not None:
        kind = cfg.lm.deployment.engine
        if kind == "sglang":
            notes.append(f"attaching to the SGLang server at {cfg.lm.sglang.base_url} ...")
        else:
            notes.append(f"starting the {kind} engine ({cfg.lm.deployment.mode}; loads the model, can take "
                         "minutes) ...")
    return [f"step {ckpt.step + 1}/{cfg.loop.total_steps}: {n}" for n in notes]


def run_steps(cfg, run_uri: str, family: str, first: int, step: Callable[[int], tuple[dict, SampleBatch]], *,
              show: bool, line: Callable[[int, int, dict, float, float], str], on_step: StepCallback | None,
              evaluate_start: Callable[[], tuple[dict, str]]) -> list[dict]:
    """The driver's loop, for every kind of run (an RL run's ``cfg`` or a compose run's): ``step(n)`` for ``n`` in
    ``first..loop.total_steps`` (it returns the step's metrics and batch); each step's record gets ``step`` and
    ``time/step``, goes to the sinks ``cfg.report`` asks for (``open_sinks`` on ``run_uri``, when a step remains),
    prints ``line`` and is handed to ``on_step``. A run that starts at step 1 with ``cfg.eval`` due at step 0 first
    evaluates its starting policy (the "before" of the report's held-out before/after): ``evaluate_start()`` returns
    its ``eval/*`` metrics, logged at step 0, and the line to print. Returns the steps' records."""
    total = cfg.loop.total_steps
    scalars = open_sinks(cfg.report, run_uri, cfg.name, storage_options=cfg.checkpoint.storage_options,
                         run_config={"recipe": cfg.name, "family": family}) if first <= total else MetricSinks()
    try:
        if cfg.eval is not None and first == 1 <= total and cfg.eval.due(0, total):
            metrics, message = evaluate_start()
            scalars.log(0, metrics)
            say(message, show)
        history: list[dict] = []
        started = time.perf_counter()
        for n in range(first, total + 1):
            t0 = time.perf_counter()
            metrics, batch = step(n)
            seconds = time.perf_counter() - t0
            metrics.update({"step": float(n), "time/step": seconds})
            history.append(metrics)
            eta = (time.perf_counter() - started) / len(history) * (total - n)
            scalars.log(n, metrics)
            say(line(n, total, metrics, seconds, eta), show)
            if on_step is not None:
                on_step(metrics, batch)
        return history
    finally:
        scalars.close()


def _run_steps(cfg: RunConfig, ckpt: CheckpointRef, on_step: StepCallback | None, show: bool) -> list[dict]:
    for note in first_step_notes(cfg, ckpt):
        say(note, show)
    # lag 0: each step samples its own rollout; async_training.max_policy_lag > 0: the rollout manager's, sampled
    # with lagged versions (unirl_core/loop/lagged.py). Made after the step-0 evaluation, which would load weights
    # into the rollout model the manager samples with.
    rollouts, version = None, ckpt

    def step(n: int) -> tuple[dict, SampleBatch]:
        nonlocal rollouts, version
        rollouts = rollouts or rollout_source(cfg, ckpt)
        metrics, batch, version = rl_step(cfg, version, n, rollouts)
        return metrics, batch

    def evaluate_start() -> tuple[dict, str]:
        start = evaluate_into_report(cfg, ckpt)
        return start, (f"step 0/{cfg.loop.total_steps} | eval {start.get('eval/reward/mean', math.nan):.4f} "
                       "(starting policy, held out)")

    try:
        history = run_steps(cfg, f"{cfg.checkpoint.root.rstrip('/')}/{cfg.name}", cfg.family, ckpt.step + 1, step,
                            show=show, line=progress_line, on_step=on_step, evaluate_start=evaluate_start)
    except BaseException:
        try:  # the version in flight completes (or stays invisible); the step's own error is the one raised
            finish_writes()
        except Exception as e:  # noqa: BLE001
            log.error("the background checkpoint write also failed: %s", e)
        raise
    finally:
        if rollouts is not None:
            rollouts.close()
    finish_writes()  # the run ends with its last version written and published
    if history:
        say(resume.ended_message(cfg, int(history[-1]["step"])), show)
    return history


def evaluate_into_report(cfg: RunConfig, ckpt: CheckpointRef) -> dict[str, float]:
    """The eval phase on ``ckpt``, its per-prompt samples and metrics written to the run report's ``eval/``
    (``<checkpoint.root>/<run>/report``) and the report's index re-rendered; returns the ``eval/*`` metrics."""
    batch, metrics = eval_phase(cfg, ckpt)
    report = RunReport(f"{cfg.checkpoint.root.rstrip('/')}/{cfg.name}", storage_options=cfg.checkpoint.storage_options)
    report.record_eval(ckpt.step, batch, metrics)
    report.render(title=f"run {cfg.name}")
    return metrics


def rl_step(cfg: RunConfig, ckpt: CheckpointRef, step: int,
            rollouts: RolloutSource) -> tuple[dict, SampleBatch, CheckpointRef]:
    """One RL step from version ``ckpt``: rollout -> reward -> [dynamic sampling] -> advantage -> train -> publish
    [-> eval]; returns its metrics (with ``time/<phase>``), the trained batch and the new version."""
    t = {}
    t0 = time.perf_counter()
    parts, per_shard, extra = rollouts.take(step)
    metrics = merge_shard_metrics(per_shard)
    metrics.update(extra)
    batch = SampleBatch.concat(parts)
    t["rollout"] = time.perf_counter() - t0
    batch = timed(t, metrics, "reward", reward_phase, cfg, batch)
    if cfg.filter_groups is not None:
        batch = timed(t, metrics, "dynamic_sampling", dynamic_sampling_phase, cfg, batch, ckpt, step=step)
    batch = timed(t, metrics, "advantage", advantage_phase, cfg, batch, ckpt)
    # lag 0: nothing reads the store until the next train phase, so the version is written on a background
    # thread while the next rollout samples with the trainer's copy of its weights
    ckpt = timed(t, metrics, "train", train_phase, cfg, batch, ckpt, step=step,
                 asynchronous=rollouts.background_writes)
    t1 = time.perf_counter()
    metrics.update(rollouts.before_publish())  # pool: no rollout may be mid-sample on the engines' weights
    published = publish_phase(cfg, ckpt, asynchronous=rollouts.background_writes)
    rollouts.mark_available(ckpt)  # the next rollout (or a partial one waiting for this version) samples with it
    metrics.update({k: float(v) for k, v in published.items() if k.startswith("pool/")})
    t["publish"] = time.perf_counter() - t1
    if cfg.eval is not None and cfg.eval.due(step, cfg.loop.total_steps):
        t1 = time.perf_counter()
        rollouts.quiesce()  # eval loads its version into the rollout model a sampler thread may use
        finish_writes()  # eval reads the version (and the report) from the store
        metrics.update(evaluate_into_report(cfg, ckpt))  # held-out, deterministic: eval/* in the step's record
        t["eval"] = time.perf_counter() - t1
    rollouts.published(ckpt)  # after eval: the version admits the next rollouts (and ends a quiesce)
    metrics.update({f"time/{k}": v for k, v in t.items()})
    return metrics, batch, ckpt
