"""SFT tasks: setup, init, one chunk of training, publish, report, export. Each calls one ``unirl_core.sft`` function.

``SFTConfig`` travels as a STRING literal of canonical JSON (sorted keys), rebuilt and re-validated with
``from_dict`` in every task, for the reasons ``run_types.py`` gives for ``RunConfig``.
"""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

from flytekit import FlyteContext, task
from flytekit.core.type_engine import TypeTransformerFailedError
from flytekit.extend import TypeEngine, TypeTransformer
from flytekit.models.literals import Literal, Primitive, Scalar
from flytekit.models.types import LiteralType, SimpleType

from images import train_image
from tasks.common import (
    CPU_TASK,
    DECK,
    DEFAULT_ACCELERATOR,
    GPU_TASK,
    SMALL_TIMEOUT,
    TRAIN_TIMEOUT,
    chunk_steps,
    deck,
    phase,
)
from tasks.run_types import HashedCheckpointRef, use_storage_options
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.loader import from_dict, to_dict
from unirl_core.report.phase_html import metrics_table
from unirl_core.sft.config import SFTConfig, load_sft_recipe

SFT_CONFIG_META = {"unirl.type": "SFTConfig", "encoding": "json"}


@functools.lru_cache(maxsize=16)
def _parse(raw: str) -> SFTConfig:
    return from_dict(SFTConfig, json.loads(raw), "SFTConfig")


class SFTConfigTransformer(TypeTransformer[SFTConfig]):
    def __init__(self) -> None:
        super().__init__(name="SFTConfig", t=SFTConfig)

    def get_literal_type(self, t: type[SFTConfig]) -> LiteralType:
        return LiteralType(simple=SimpleType.STRING, metadata=SFT_CONFIG_META)

    def to_literal(self, ctx: FlyteContext, python_val: SFTConfig, python_type: type[SFTConfig],
                   expected: LiteralType) -> Literal:
        if not isinstance(python_val, SFTConfig):
            raise TypeTransformerFailedError(f"expected an SFTConfig, got {type(python_val).__name__}")
        raw = json.dumps(to_dict(python_val), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return Literal(scalar=Scalar(primitive=Primitive(string_value=raw)))

    def to_python_value(self, ctx: FlyteContext, lv: Literal, expected_python_type: type[SFTConfig]) -> SFTConfig:
        raw = lv.scalar.primitive.string_value if lv.scalar and lv.scalar.primitive else None
        if raw is None:
            raise TypeTransformerFailedError(f"expected a STRING literal holding SFTConfig JSON, got {lv}")
        return _parse(raw)

    def guess_python_type(self, literal_type: LiteralType) -> type[SFTConfig]:
        if literal_type.simple == SimpleType.STRING and literal_type.metadata == SFT_CONFIG_META:
            return SFTConfig
        raise ValueError(f"cannot guess an SFTConfig from {literal_type}")


TypeEngine.register(SFTConfigTransformer())

if train_image.is_container():
    from unirl_core.sft import phases
    from unirl_core.sft.local import StepLog
    from unirl_core.sft.report import write_sft_report


@task(container_image=train_image, **CPU_TASK, timeout=SMALL_TIMEOUT, **DECK)
def sft_setup_task(recipe: str, overrides: list[str]) -> SFTConfig:
    """Load and validate the SFT recipe with its ``a.b=value`` overrides (a bad field fails here)."""
    cfg = load_sft_recipe(recipe, list(overrides))
    deck("config", f"<pre>{json.dumps(to_dict(cfg), indent=1, sort_keys=True)}</pre>")
    return cfg


@task(container_image=train_image, **CPU_TASK, retries=2, timeout=SMALL_TIMEOUT)
def sft_init_task(cfg: SFTConfig, resume: str) -> HashedCheckpointRef:
    """The published version of the run, or a fresh step-0 version (``resume``: ``latest`` / ``never``)."""
    timings: dict[str, float] = {}
    with phase("init", timings):
        ref = phases.init_sft(cfg, resume_from=resume)
    use_storage_options(cfg)
    return ref


class SFTTrained(NamedTuple):
    ckpt: HashedCheckpointRef
    metrics: dict[str, float]
    """The chunk's last step's metrics, plus ``sft/loss_chunk_mean`` and ``time/train``."""


# not cached: a cached ref could name a version that retention has since deleted
@task(container_image=train_image, accelerator=DEFAULT_ACCELERATOR, retries=1, timeout=TRAIN_TIMEOUT, **GPU_TASK,
      **DECK)
def sft_train_task(cfg: SFTConfig, ckpt: CheckpointRef) -> SFTTrained:
    """``loop.steps_per_chunk`` steps from ``ckpt`` (more in a long local run: ``tasks.common.chunk_steps``);
    writes (unpublished) the chunk's last step."""
    metrics: dict[str, float] = {}
    log = StepLog(cfg, show=False)
    try:
        with phase("train", metrics):
            new, history = phases.train_chunk(cfg, ckpt, on_step=log, num_steps=chunk_steps(
                cfg.loop.steps_per_chunk, cfg.loop.total_steps))
    finally:
        log.close()
    if history:
        metrics.update(history[-1])
        metrics["sft/loss_chunk_mean"] = sum(h["sft/loss"] for h in history) / len(history)
    deck("train", metrics_table(metrics, f"steps {ckpt.step + 1}..{new.step}") + "<pre>" + "\n".join(log.lines)
         + "</pre>")
    use_storage_options(cfg)
    return SFTTrained(ckpt=new, metrics=metrics)


@task(container_image=train_image, **CPU_TASK, retries=3, timeout=SMALL_TIMEOUT)
def sft_publish_task(cfg: SFTConfig, ckpt: CheckpointRef) -> HashedCheckpointRef:
    """Make the chunk's version the run's published one."""
    timings: dict[str, float] = {}
    with phase("publish", timings):
        phases.publish_sft(cfg, ckpt)
    use_storage_options(cfg)
    return ckpt


@task(container_image=train_image, **CPU_TASK, retries=2, timeout=SMALL_TIMEOUT)
def sft_report_task(cfg: SFTConfig, ckpt: CheckpointRef) -> str:
    """``<root>/<run>/report/index.html``: loss curves, config, and (diffusion) samples of ``ckpt``."""
    return write_sft_report(cfg, ckpt)


@task(container_image=train_image, **CPU_TASK, retries=2, timeout=SMALL_TIMEOUT)
def sft_export_task(cfg: SFTConfig, ckpt: CheckpointRef) -> str:
    """``ckpt`` as a ``save_pretrained`` folder the RL loop starts from (``<root>/<run>/export``)."""
    return phases.export_model(cfg, ckpt)
