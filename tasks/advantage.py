"""Advantage: group-normalised advantages (the per-prompt tracker state is read from the checkpoint)."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task

from images import train_image
from tasks.common import CACHE_VERSION, CPU_TASK, DECK, SMALL_TIMEOUT, deck, phase
from tasks.types import HashedSampleBatch
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config import RunConfig
from unirl_core.report.phase_html import advantage_html
from unirl_core.types import SampleBatch

if train_image.is_container():
    from unirl_core.loop import phases


class WithAdvantages(NamedTuple):
    batch: HashedSampleBatch
    metrics: dict[str, float]


@task(container_image=train_image, **CPU_TASK, retries=2, timeout=SMALL_TIMEOUT, cache=True,
      cache_version=CACHE_VERSION, **DECK)
def advantage_task(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef) -> WithAdvantages:
    metrics: dict[str, float] = {}
    with phase("advantage", metrics):
        out, m = phases.advantage_phase(cfg, batch, ckpt)
    metrics.update(m)
    deck("advantage", advantage_html(out, metrics))
    return WithAdvantages(batch=out, metrics=metrics)
