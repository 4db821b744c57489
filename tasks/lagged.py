"""Lagged rollouts: the checkpoint of an earlier version, for a rollout that samples behind training."""

from __future__ import annotations

from flytekit import task

from images import train_image
from tasks.common import CPU_TASK, SMALL_TIMEOUT
from tasks.run_types import HashedCheckpointRef, use_storage_options
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config import RunConfig

if train_image.is_container():
    from unirl_core.loop import lagged


# not cached: it reads the run's store, which later steps change
@task(container_image=train_image, **CPU_TASK, retries=3, timeout=SMALL_TIMEOUT)
def lagged_version_task(cfg: RunConfig, ckpt: CheckpointRef, version: int) -> HashedCheckpointRef:
    """Version ``version`` of the run (older than ``ckpt``, kept by ``checkpoint.keep_last``)."""
    ref = lagged.lagged_checkpoint(cfg, ckpt, version)
    use_storage_options(cfg)
    return ref
