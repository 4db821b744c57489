"""Report: per-step artifacts in the run directory, the HTML run report, TensorBoard scalars, the progress line."""

from __future__ import annotations

import json

from flytekit import current_context, task

from images import train_image
from tasks.common import CPU_TASK, SMALL_TIMEOUT, progress_logger
from unirl_core.config import RunConfig
from unirl_core.loop.local import progress_line
from unirl_core.loop.resume import ended_message
from unirl_core.report.phase_html import advantage_html, publish_html, reward_html, rollout_html, train_html
from unirl_core.report.run_report import RunReport, StepRecord, step_seconds
from unirl_core.report.tensorboard import ScalarLog
from unirl_core.report.mlflow_log import MlflowLog
from unirl_core.report.wandb_log import WandbLog
from unirl_core.types import SampleBatch


def run_report(cfg: RunConfig) -> RunReport:
    """The run directory's report under the checkpoint root: ``<root>/<run>/report``."""
    return RunReport(f"{cfg.checkpoint.root.rstrip('/')}/{cfg.name}", storage_options=cfg.checkpoint.storage_options)


def write_scalars(cfg: RunConfig, step: int, metrics: dict[str, float]) -> None:
    """Step ``step``'s metrics as TensorBoard scalars in ``<root>/<run>/tensorboard`` (unless
    ``report.tensorboard`` is off); one event file per report task, TensorBoard reads them all as one run."""
    if cfg.report.tensorboard:
        with ScalarLog(f"{cfg.checkpoint.root.rstrip('/')}/{cfg.name}",
                       storage_options=cfg.checkpoint.storage_options) as scalars:
            scalars.log(step, metrics)


def write_wandb(cfg: RunConfig, step: int, metrics: dict[str, float]) -> str | None:
    """Step ``step``'s metrics into the run's W&B run (resumed by id, so every report task of the execution
    adds to one run; the execution is recorded in the run's config and notes); returns the run's URL."""
    if cfg.report.wandb is None:
        return None
    with WandbLog(cfg.report.wandb, cfg.name, run_config={"recipe": cfg.name, "family": cfg.family},
                  execution=_execution()) as wb:
        wb.log(step, metrics)
        return wb.url


def write_mlflow(cfg: RunConfig, step: int, metrics: dict[str, float]) -> None:
    """Step ``step``'s metrics into the run's MLflow run (found again by its ``unirl.run`` tag by every report
    task); nothing without ``report.mlflow``."""
    if cfg.report.mlflow is None:
        return
    with MlflowLog(cfg.report.mlflow, cfg.name, run_config={"recipe": cfg.name, "family": cfg.family},
                   execution=_execution()) as ml:
        ml.log(step, metrics)


def _execution() -> str | None:
    try:
        return current_context().execution_id.name
    except Exception:  # noqa: BLE001 - outside a Flyte task (a direct call in a test): no execution to link
        return None


def progress(records: list[StepRecord], rec: StepRecord, total: int, session: str) -> str:
    """The progress line of ``rec``: wall time since the previous step of this session (the first step of a
    session only has its phase compute time), ETA from the mean step time of this session."""
    times = step_seconds(records, session)
    compute = sum(v for k, v in rec.metrics.items() if k.startswith("time/"))
    mine = [r for r in records if r.session == session]
    last = times[-1] if len(mine) > 1 and times and mine[-2].step == rec.step - 1 else compute
    mean = sum(times) / len(times) if times else compute
    return progress_line(rec.step, total, rec.metrics, last, mean * max(total - rec.step, 0))


@task(container_image=train_image, **CPU_TASK, retries=2, timeout=SMALL_TIMEOUT)
def report_task(cfg: RunConfig, session: str, step: int, batch: SampleBatch, rollout: dict[str, float],
                reward: dict[str, float], advantage: dict[str, float], train: dict[str, float],
                published: str, evaluation: dict[str, float] | None = None) -> int:
    """Write step ``step`` into the run report, re-render ``index.html`` (``report.index_every_n_steps``), add its
    TensorBoard scalars (and W&B / MLflow metrics when set) and log the progress line.

    ``evaluation``: the ``eval/*`` metrics of this step's version when it was evaluated (charted in the index).
    Returns ``step`` so the workflow can order the reports of consecutive steps (one writer of index.html)."""
    info = json.loads(published)
    metrics = {**rollout, **reward, **advantage, **train, **(evaluation or {})}
    metrics["time/publish"] = float(info.get("time/publish", 0.0))
    pages = {"rollout": rollout_html(batch, rollout), "reward": reward_html(batch, reward),
             "advantage": advantage_html(batch, advantage), "train": train_html(train), "publish": publish_html(info)}
    report = run_report(cfg)
    rec = report.record_step(step, metrics=metrics, batch=batch, pages=pages, session=session)
    if cfg.report.renders_index(step, cfg.loop.total_steps):
        report.render(title=f"run {cfg.name}")
    write_scalars(cfg, step, rec.metrics)
    url = write_wandb(cfg, step, rec.metrics)
    write_mlflow(cfg, step, rec.metrics)
    if url:
        progress_logger().info("W&B run: %s", url)
    progress_logger().info(progress(report.steps(), rec, cfg.loop.total_steps, session))
    if step >= cfg.loop.total_steps:
        progress_logger().info(ended_message(cfg, step, decks=True))
    return step
