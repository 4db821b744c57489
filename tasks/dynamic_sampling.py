"""Dynamic sampling (DAPO, ``filter_groups``): drop flat groups of the scored batch, refill with extra rounds.

It samples and scores (extra rounds of rollout + reward over new prompts), so it runs on the reward image (the
rollout image's model stack plus the scorers) with a GPU. The workflow wires it between reward and advantage
only when ``filter_groups`` is set.
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task

from images import reward_image
from tasks.common import CACHE_VERSION, DECK, DEFAULT_ACCELERATOR, GPU_TASK, ROLLOUT_TIMEOUT, deck, phase
from tasks.types import HashedSampleBatch
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config import RunConfig
from unirl_core.report.phase_html import reward_html
from unirl_core.types import SampleBatch

if reward_image.is_container():
    from unirl_core.loop import phases


class Filtered(NamedTuple):
    batch: HashedSampleBatch
    metrics: dict[str, float]


@task(container_image=reward_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=2,
      timeout=ROLLOUT_TIMEOUT, cache=True, cache_version=CACHE_VERSION, **DECK)
def dynamic_sampling_task(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, step: int,
                          reward_metrics: dict[str, float]) -> Filtered:
    """``data.prompts_per_step`` groups with reward spread where the rounds allow; metrics: the reward
    phase's plus ``filter_groups/*`` (so the run report shows both)."""
    metrics: dict[str, float] = dict(reward_metrics)
    with phase("dynamic_sampling", metrics):
        out, m = phases.dynamic_sampling_phase(cfg, batch, ckpt, step=step)
    metrics.update(m)
    deck("dynamic sampling", reward_html(out, metrics))
    return Filtered(batch=out, metrics=metrics)
