"""Train: one rollout batch of updates from a checkpoint; writes (unpublished) version ``step``.

``train_task`` trains in its own process (world size 1). For multi-GPU training the workflow picks one of
the PyTorch-Elastic variants below by ``cluster.train_nnodes x cluster.train_nproc_per_node``: a task's
plugin config is fixed when the module is imported (flytekit's ``with_overrides(task_config=...)`` mutates
the shared task object and cannot change the task type), so each topology is its own registered task.
Single-node variants run torch elastic inside one pod; multi-node ones compile to a PyTorchJob.
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import Resources, task
from flytekitplugins.kfpytorch import Elastic

from images import train_image
from tasks.common import DECK, DEFAULT_ACCELERATOR, GPU_TASK, TRAIN_TIMEOUT, deck, phase
from tasks.run_types import HashedCheckpointRef, use_storage_options
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config import RunConfig
from unirl_core.report.phase_html import train_html
from unirl_core.types import SampleBatch


class Trained(NamedTuple):
    ckpt: HashedCheckpointRef
    metrics: dict[str, float]


def _train(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, step: int) -> Trained:
    # imported here, not behind ImageSpec.is_container(): torch elastic's spawned workers run in task-execution
    # mode without the image id in their environment, so the guard would skip the import there
    from unirl_core.loop import phases
    from unirl_core.train.distributed import init_distributed

    metrics: dict[str, float] = {}
    init_distributed()  # joins the group torch elastic describes in the env; no-op at world size 1
    with phase("train", metrics):
        new, m = phases.train_phase(cfg, batch, ckpt, step=step)
    metrics.update(m)
    deck("train", train_html(metrics))
    use_storage_options(cfg)
    return Trained(ckpt=new, metrics=metrics)


# not cached: a cached ref could name a version that retention has since deleted
_COMMON = dict(container_image=train_image, accelerator=DEFAULT_ACCELERATOR, retries=1, timeout=TRAIN_TIMEOUT,
               **DECK)


def _elastic(nnodes: int, nproc: int) -> dict:
    # shared_memory on the task instead of Elastic(increase_shared_mem=...), which flytekit deprecates
    return dict(task_config=Elastic(nnodes=nnodes, nproc_per_node=nproc, increase_shared_mem=False),
                shared_memory=True)


def _gpus(n: int) -> dict:
    return dict(requests=Resources(cpu=str(8 * n), mem=f"{64 * n}Gi", gpu=str(n)),
                limits=Resources(mem=f"{96 * n}Gi", gpu=str(n)))


@task(**_COMMON, **GPU_TASK)
def train_task(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, step: int) -> Trained:
    return _train(cfg, batch, ckpt, step)


@task(**_COMMON, **_gpus(2), **_elastic(1, 2))
def train_elastic_1x2(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, step: int) -> Trained:
    return _train(cfg, batch, ckpt, step)


@task(**_COMMON, **_gpus(4), **_elastic(1, 4))
def train_elastic_1x4(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, step: int) -> Trained:
    return _train(cfg, batch, ckpt, step)


@task(**_COMMON, **_gpus(8), **_elastic(1, 8))
def train_elastic_1x8(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, step: int) -> Trained:
    return _train(cfg, batch, ckpt, step)


@task(**_COMMON, **_gpus(8), **_elastic(2, 8))
def train_elastic_2x8(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, step: int) -> Trained:
    return _train(cfg, batch, ckpt, step)


@task(**_COMMON, **_gpus(8), **_elastic(4, 8))
def train_elastic_4x8(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, step: int) -> Trained:
    return _train(cfg, batch, ckpt, step)


TRAIN_TASKS = {(1, 1): train_task, (1, 2): train_elastic_1x2, (1, 4): train_elastic_1x4, (1, 8): train_elastic_1x8,
               (2, 8): train_elastic_2x8, (4, 8): train_elastic_4x8}
"""(nnodes, nproc_per_node) -> train task; keep in step with run_types.TRAIN_TOPOLOGIES."""
