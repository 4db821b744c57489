"""Reward: score every sample (per component and weighted total)."""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task

from images import reward_image
from tasks.common import CACHE_VERSION, DECK, DEFAULT_ACCELERATOR, GPU_TASK, REWARD_TIMEOUT, deck, phase
from tasks.types import HashedSampleBatch
from unirl_core.config import RunConfig
from unirl_core.report.phase_html import reward_html
from unirl_core.types import SampleBatch

if reward_image.is_container():
    from unirl_core.loop import phases


class Scored(NamedTuple):
    batch: HashedSampleBatch
    metrics: dict[str, float]


# retries: a remote reward server timing out (its client has already retried) raises a recoverable error
@task(container_image=reward_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=3, timeout=REWARD_TIMEOUT,
      cache=True, cache_version=CACHE_VERSION, **DECK)
def reward_task(cfg: RunConfig, batch: SampleBatch) -> Scored:
    metrics: dict[str, float] = {}
    with phase("reward", metrics):
        scored, m = phases.reward_phase(cfg, batch)
    metrics.update(m)
    deck("reward", reward_html(scored, metrics))
    return Scored(batch=scored, metrics=metrics)
