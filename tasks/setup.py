"""Setup tasks: parse the recipe once, and find (or write) the checkpoint the loop starts from."""

from __future__ import annotations

import dataclasses
import html
import json
import uuid
from typing import NamedTuple

from flytekit import task

from images import train_image
from tasks import resources
from tasks.common import (
    CPU_TASK,
    DECK,
    SMALL_TIMEOUT,
    deck,
    local_execution,
    phase,
    progress_logger,
    say_resume_on_interrupt,
    session_id,
)
from tasks.report import run_report
from tasks.run_types import (
    ClusterConfig,
    HashedCheckpointRef,
    load_run_config,
    use_storage_options,
)
from unirl_core.config import RunConfig, to_dict
from unirl_core.config.preflight import preflight
from unirl_core.pool.kuberay import setup_pool
from unirl_core.report.phase_html import metrics_table
from unirl_core.rollout.agentic import check_agent_workflow

if train_image.is_container():
    from unirl_core.loop import phases
    from unirl_core.loop.resume import forked_config
    from unirl_core.loop.run_init import run_lease


class Setup(NamedTuple):
    cfg: RunConfig
    cluster: ClusterConfig
    session: str


@task(container_image=train_image, **CPU_TASK, timeout=SMALL_TIMEOUT, **DECK)
def setup_task(recipe: str, overrides: list[str]) -> Setup:
    """Load and validate the recipe with its overrides, then preflight it: the checkpoint root is writable and
    the models are reachable (a bad override or an unusable root fails here, before any GPU starts); with
    ``pool.kuberay`` the pool's RayCluster spec is validated and written as ``<root>/<run>/pool/raycluster.yaml``."""
    cfg, cluster = load_run_config(recipe, overrides)
    cfg.async_training.check_workflow()
    cfg.loop.check_workflow()
    cfg = dataclasses.replace(cfg, checkpoint=cfg.checkpoint.for_workflow(cfg.pool.execution))
    resources.check_all(cfg, cluster)  # the recipe's pods (cluster: section over its shape's defaults)
    check_agent_workflow(cfg)
    # a local execution starts any vLLM server here; on a cluster the engine's pod has its own interpreter
    for note in preflight(cfg, engines_here=local_execution()):
        progress_logger().warning("preflight: %s", note)
    for note in setup_pool(cfg):  # pool.kuberay: the RayCluster spec, validated and written next to the run
        progress_logger().warning("pool: %s", note)
    deck("config", f"<pre>{html.escape(json.dumps(to_dict(cfg), indent=1, sort_keys=True))}</pre>"
         + metrics_table(dataclasses.asdict(cluster), "cluster"))
    # local executions all share the execution name 'local': add a random suffix so step times of two
    # local sessions of one run are never mixed up in the progress line
    return Setup(cfg=cfg, cluster=cluster, session=f"{session_id()}-{uuid.uuid4().hex[:8]}")


class Start(NamedTuple):
    cfg: RunConfig
    """The config the loop runs with: the setup's, named ``fork_as`` for a fork."""
    ckpt: HashedCheckpointRef


@task(container_image=train_image, **CPU_TASK, retries=2, timeout=SMALL_TIMEOUT)
def init_task(cfg: RunConfig, resume: str, fork_as: str) -> Start:
    """``resume``: ``latest`` (the run's published version, or a fresh step-0 version), ``never`` (the run
    must be empty) or one version folder of this run (URI or path); ``fork_as``: "" or the name of a new
    run that starts from that version (``init_run``)."""
    timings: dict[str, float] = {}
    fork = fork_as or None
    # one writer per run: this execution takes the run's lease (renewed by each publish, released by release_task)
    run_lease(forked_config(cfg, fork)).acquire()
    with phase("init", timings):
        ckpt = phases.init_run(cfg, resume_from=resume, fork_as=fork)
    run_cfg = forked_config(cfg, fork)
    run_report(run_cfg).write_config(to_dict(run_cfg))
    use_storage_options(run_cfg)
    say_resume_on_interrupt(run_cfg)
    return Start(cfg=run_cfg, ckpt=ckpt)
