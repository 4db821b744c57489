"""Prompt enhancement as a Flyte workflow: an AR enhancer Part chained into a diffusion Part, both trained.

    pyflyte run workflows/enhance.py enhance --recipe shapes-enhance
    pyflyte run workflows/enhance.py enhance --recipe shapes-enhance --overrides '["loop.total_steps=4"]'

Per step: rollout (one SampleBatch, both Parts) -> score (image reward, propagation, advantages per Part) -> train
(both stacks, each its own optimizer and version) -> publish (both) -> [eval when due] -> report. ``enhance_chunk`` is
a @dynamic over ``loop.steps_per_chunk`` steps that calls itself for the next chunk. Only wiring lives here.
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import dynamic, workflow

from images import train_image
from tasks.common import CPU_TASK, chunk_steps
from tasks.compose import (
    compose_eval_task,
    compose_init_task,
    compose_publish_task,
    compose_report_task,
    compose_rollout_task,
    compose_score_task,
    compose_setup_task,
    compose_train_task,
)
from unirl_core.checkpoint import CheckpointRef
from unirl_core.compose.config import ComposeRunConfig


class Versions(NamedTuple):
    enhancer: CheckpointRef
    """The enhancer stack's last published version."""
    image: CheckpointRef
    """The image stack's last published version."""


@dynamic(container_image=train_image, **CPU_TASK)
def enhance_chunk(cfg: ComposeRunConfig, enhancer: CheckpointRef, image: CheckpointRef, report: str) -> Versions:
    """Steps of one chunk from the given versions, then the next chunk; returns the last published versions."""
    first = max(enhancer.step, image.step) + 1
    total = cfg.loop.total_steps
    if first > total:
        return Versions(enhancer=enhancer, image=image)
    for step in range(first, min(first + chunk_steps(cfg.loop.steps_per_chunk, total), total + 1)):
        rolled = compose_rollout_task(cfg=cfg, enhancer=enhancer, image=image, step=step)
        scored = compose_score_task(cfg=cfg, batch=rolled.batch)
        trained = compose_train_task(cfg=cfg, batch=scored.batch, enhancer=enhancer, image=image, step=step)
        published = compose_publish_task(cfg=cfg, enhancer=trained.enhancer, image=trained.image)
        enhancer, image = published.enhancer, published.image
        evaluation, texts = {}, {}
        if cfg.eval is not None and cfg.eval.due(step, total):
            evaluated = compose_eval_task(cfg=cfg, enhancer=enhancer, image=image)
            evaluation, texts = evaluated.metrics, evaluated.enhancements
        report = compose_report_task(cfg=cfg, batch=scored.batch, step=step, rollout=rolled.metrics,
                                     score=scored.metrics, train=trained.metrics, evaluation=evaluation,
                                     enhancements=texts, after=report)
    return enhance_chunk(cfg=cfg, enhancer=enhancer, image=image, report=report)


@workflow
def enhance(recipe: str = "shapes-enhance", overrides: list[str] = [],  # noqa: B006 (flytekit copies defaults)
            resume: str = "latest") -> Versions:
    """Train compose ``recipe`` (a shipped name or a YAML path) with ``a.b=value`` overrides; ``resume``: ``latest``
    continues both stacks' published versions, ``never`` requires an empty run. The report lands in
    ``<checkpoint.root>/<name>/report/index.html``."""
    cfg = compose_setup_task(recipe=recipe, overrides=overrides)
    start = compose_init_task(cfg=cfg, resume=resume)
    return enhance_chunk(cfg=cfg, enhancer=start.enhancer, image=start.image, report="")
