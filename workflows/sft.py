"""Supervised fine-tuning as a Flyte workflow: records -> supervised Parts -> train, no rollout or reward.

    pyflyte run workflows/sft.py sft --recipe sft-shapes
    pyflyte run workflows/sft.py sft --recipe sft-tiny-lm --overrides '["data.path=my.jsonl"]'

``sft_chunks`` is a @dynamic that wires one chunk (train ``loop.steps_per_chunk`` steps -> publish) and calls
itself for the next, so the DAG stays bounded. At the end the published version is rendered into the run
report and exported as a ``save_pretrained`` folder the RL loop starts from. Only wiring lives here.
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import dynamic, workflow

from images import train_image
from tasks.common import CPU_TASK
from tasks.sft import (
    sft_export_task,
    sft_init_task,
    sft_publish_task,
    sft_report_task,
    sft_setup_task,
    sft_train_task,
)
from unirl_core.checkpoint import CheckpointRef
from unirl_core.sft.config import SFTConfig


@dynamic(container_image=train_image, **CPU_TASK)
def sft_chunks(cfg: SFTConfig, ckpt: CheckpointRef) -> CheckpointRef:
    """One chunk from ``ckpt`` (train, publish), then the next chunk; returns the last published version."""
    if ckpt.step >= cfg.loop.total_steps:
        return ckpt
    trained = sft_train_task(cfg=cfg, ckpt=ckpt)
    published = sft_publish_task(cfg=cfg, ckpt=trained.ckpt)
    return sft_chunks(cfg=cfg, ckpt=published)


class SFTResult(NamedTuple):
    ckpt: CheckpointRef
    """The published version after the last step."""
    export: str
    """``save_pretrained`` folder of that version: ``diffusion.model.source`` / ``lm.model.model`` of an RL run."""
    report: str
    """The run report's ``index.html``."""


@workflow
def sft(recipe: str = "sft-shapes", overrides: list[str] = [],  # noqa: B006 (flytekit copies defaults)
        resume: str = "latest") -> SFTResult:
    """Train SFT ``recipe`` (a shipped ``sft-*`` name or a YAML path) with ``a.b=value`` overrides.

    ``resume``: ``latest`` continues the run's published version (an empty run starts from the untrained model),
    ``never`` requires an empty run."""
    cfg = sft_setup_task(recipe=recipe, overrides=overrides)
    start = sft_init_task(cfg=cfg, resume=resume)
    last = sft_chunks(cfg=cfg, ckpt=start)
    report = sft_report_task(cfg=cfg, ckpt=last)
    export = sft_export_task(cfg=cfg, ckpt=last)
    return SFTResult(ckpt=last, export=export, report=report)
