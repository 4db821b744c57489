"""Rollout: with one prompt shard, one task for the step's rollout; with more, one task per shard (mapped over the
shards by the workflow), then the shards joined."""

from __future__ import annotations

import json
from typing import NamedTuple

from flytekit import task

from images import rollout_image, train_image
from tasks.common import (
    CACHE_VERSION,
    CPU_TASK,
    DECK,
    DEFAULT_ACCELERATOR,
    GPU_TASK,
    ROLLOUT_TIMEOUT,
    SMALL_TIMEOUT,
    deck,
    phase,
)
from tasks.types import HashedSampleBatch
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config import RunConfig
from unirl_core.loop.metrics import join_shards
from unirl_core.report.phase_html import rollout_html
from unirl_core.types import SampleBatch

if rollout_image.is_container():
    from unirl_core.loop import phases

# A map task has exactly one output, so a shard's metrics ride in its batch metadata until join_shards_task.
SHARD_METRICS_KEY = "unirl.rollout_metrics"


class Joined(NamedTuple):
    batch: HashedSampleBatch
    metrics: dict[str, float]


def _rollout_shard(cfg: RunConfig, ckpt: CheckpointRef, step: int, num_shards: int,
                   shard: int) -> tuple[SampleBatch, dict[str, float]]:
    """The shard's batch and metrics (``time/rollout`` included); its page goes into the task's deck."""
    metrics: dict[str, float] = {}
    with phase("rollout", metrics):
        batch, m = phases.rollout_phase(cfg, ckpt, step=step, shard=shard, num_shards=num_shards)
    metrics.update(m)
    deck("rollout", rollout_html(batch, metrics))
    return batch, metrics


@task(container_image=rollout_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=2,
      timeout=ROLLOUT_TIMEOUT, cache=True, cache_version=CACHE_VERSION, **DECK)
def rollout_one_task(cfg: RunConfig, ckpt: CheckpointRef, step: int) -> Joined:
    """Step ``step``'s whole rollout with the weights of ``ckpt`` (``loop.rollout_shards == 1``): the batch and
    metrics the map + join path gives for one shard, without the map task and the join task."""
    batch, metrics = _rollout_shard(cfg, ckpt, step, 1, 0)
    batch, metrics = join_shards([batch], [metrics])
    return Joined(batch=batch, metrics=metrics)


@task(container_image=rollout_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=2,
      timeout=ROLLOUT_TIMEOUT, cache=True, cache_version=CACHE_VERSION, **DECK)
def rollout_task(cfg: RunConfig, ckpt: CheckpointRef, step: int, num_shards: int, shard: int) -> HashedSampleBatch:
    """Sample shard ``shard`` of step ``step`` with the weights of ``ckpt`` (mapped over the shards)."""
    batch, metrics = _rollout_shard(cfg, ckpt, step, num_shards, shard)
    batch.metadata[SHARD_METRICS_KEY] = json.dumps(metrics, sort_keys=True)
    return batch


@task(container_image=train_image, **CPU_TASK, timeout=SMALL_TIMEOUT)
def join_shards_task(shards: list[SampleBatch]) -> Joined:
    """Concatenate the shards in shard order; their metrics leave the batch metadata here."""
    per_shard = [json.loads(b.metadata.pop(SHARD_METRICS_KEY, "{}")) for b in shards]
    batch, metrics = join_shards(shards, per_shard)
    return Joined(batch=batch, metrics=metrics)
