"""Prompt-enhancement (compose) tasks: setup, init, rollout, score, train, publish, eval, report. Each calls one
``unirl_core.compose`` function.

``ComposeRunConfig`` travels as a STRING literal of canonical JSON (sorted keys), rebuilt and re-validated with
``from_dict`` in every task, for the reasons ``run_types.py`` gives for ``RunConfig``. The two stacks' versions
travel as two ``CheckpointRef``s.
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

from images import rollout_image, train_image
from tasks.common import (
    CPU_TASK,
    DECK,
    DEFAULT_ACCELERATOR,
    GPU_TASK,
    ROLLOUT_TIMEOUT,
    SMALL_TIMEOUT,
    TRAIN_TIMEOUT,
    deck,
    phase,
    progress_logger,
)
from tasks.run_types import HashedCheckpointRef, use_storage_options
from tasks.types import HashedSampleBatch
from unirl_core.checkpoint import CheckpointRef
from unirl_core.compose.config import ComposeRunConfig, load_compose_recipe
from unirl_core.config.loader import from_dict, to_dict
from unirl_core.report.phase_html import metrics_table
from unirl_core.types import SampleBatch

COMPOSE_CONFIG_META = {"unirl.type": "ComposeRunConfig", "encoding": "json"}


@functools.lru_cache(maxsize=16)
def _parse(raw: str) -> ComposeRunConfig:
    return from_dict(ComposeRunConfig, json.loads(raw), "ComposeRunConfig")


class ComposeRunConfigTransformer(TypeTransformer[ComposeRunConfig]):
    def __init__(self) -> None:
        super().__init__(name="ComposeRunConfig", t=ComposeRunConfig)

    def get_literal_type(self, t: type[ComposeRunConfig]) -> LiteralType:
        return LiteralType(simple=SimpleType.STRING, metadata=COMPOSE_CONFIG_META)

    def to_literal(self, ctx: FlyteContext, python_val: ComposeRunConfig, python_type: type[ComposeRunConfig],
                   expected: LiteralType) -> Literal:
        if not isinstance(python_val, ComposeRunConfig):
            raise TypeTransformerFailedError(f"expected a ComposeRunConfig, got {type(python_val).__name__}")
        raw = json.dumps(to_dict(python_val), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return Literal(scalar=Scalar(primitive=Primitive(string_value=raw)))

    def to_python_value(self, ctx: FlyteContext, lv: Literal,
                        expected_python_type: type[ComposeRunConfig]) -> ComposeRunConfig:
        raw = lv.scalar.primitive.string_value if lv.scalar and lv.scalar.primitive else None
        if raw is None:
            raise TypeTransformerFailedError(f"expected a STRING literal holding ComposeRunConfig JSON, got {lv}")
        return _parse(raw)

    def guess_python_type(self, literal_type: LiteralType) -> type[ComposeRunConfig]:
        if literal_type.simple == SimpleType.STRING and literal_type.metadata == COMPOSE_CONFIG_META:
            return ComposeRunConfig
        raise ValueError(f"cannot guess a ComposeRunConfig from {literal_type}")


TypeEngine.register(ComposeRunConfigTransformer())

if train_image.is_container():
    from unirl_core.compose import phases
    from unirl_core.compose.evaluate import evaluate_compose
    from unirl_core.compose.local import progress_line
    from unirl_core.compose.report import samples_html, write_step_report


class Stacks(NamedTuple):
    enhancer: HashedCheckpointRef
    image: HashedCheckpointRef


def _refs(enhancer: CheckpointRef, image: CheckpointRef) -> dict[str, CheckpointRef]:
    return {"enhancer": enhancer, "image": image}


@task(container_image=train_image, **CPU_TASK, timeout=SMALL_TIMEOUT, **DECK)
def compose_setup_task(recipe: str, overrides: list[str]) -> ComposeRunConfig:
    """Load and validate the compose recipe with its ``a.b=value`` overrides (a bad field fails here)."""
    cfg = load_compose_recipe(recipe, list(overrides))
    deck("config", f"<pre>{json.dumps(to_dict(cfg), indent=1, sort_keys=True)}</pre>")
    return cfg


@task(container_image=train_image, **CPU_TASK, retries=2, timeout=SMALL_TIMEOUT)
def compose_init_task(cfg: ComposeRunConfig, resume: str) -> Stacks:
    """Both stacks' published versions, or fresh step-0 versions (the enhancer warm-started)."""
    timings: dict[str, float] = {}
    with phase("init", timings):
        refs = phases.init_stacks(cfg, resume_from=resume)
    use_storage_options(cfg)
    return Stacks(enhancer=refs["enhancer"], image=refs["image"])


class Rolled(NamedTuple):
    batch: HashedSampleBatch
    metrics: dict[str, float]


@task(container_image=rollout_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=2, timeout=ROLLOUT_TIMEOUT,
      **DECK)
def compose_rollout_task(cfg: ComposeRunConfig, enhancer: CheckpointRef, image: CheckpointRef, step: int) -> Rolled:
    """Step ``step``'s SampleBatch: every Sample ``[enhancement (ar), image (diffusion, parent 0)]``."""
    metrics: dict[str, float] = {}
    with phase("rollout", metrics):
        batch, m = phases.rollout_phase(cfg, _refs(enhancer, image), step=step)
    metrics.update(m)
    deck("rollout", samples_html(batch))
    return Rolled(batch=batch, metrics=metrics)


@task(container_image=rollout_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=2, timeout=SMALL_TIMEOUT,
      **DECK)
def compose_score_task(cfg: ComposeRunConfig, batch: SampleBatch) -> Rolled:
    """Image rewards, their propagation to the enhancements, and each Part's advantages."""
    metrics: dict[str, float] = {}
    with phase("score", metrics):
        scored, m = phases.score_phase(cfg, batch)
    metrics.update(m)
    deck("score", metrics_table(metrics, "score") + samples_html(scored))
    return Rolled(batch=scored, metrics=metrics)


class Trained(NamedTuple):
    enhancer: HashedCheckpointRef
    image: HashedCheckpointRef
    metrics: dict[str, float]


# not cached: a cached ref could name a version that retention has since deleted
@task(container_image=train_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=1, timeout=TRAIN_TIMEOUT,
      **DECK)
def compose_train_task(cfg: ComposeRunConfig, batch: SampleBatch, enhancer: CheckpointRef, image: CheckpointRef,
                       step: int) -> Trained:
    """One update of each trained stack (its own optimizer state restored); writes version ``step`` of each."""
    metrics: dict[str, float] = {}
    with phase("train", metrics):
        refs, m = phases.train_phase(cfg, batch, _refs(enhancer, image), step=step)
    metrics.update(m)
    deck("train", metrics_table(metrics, f"step {step}"))
    use_storage_options(cfg)
    return Trained(enhancer=refs["enhancer"], image=refs["image"], metrics=metrics)


@task(container_image=train_image, **CPU_TASK, retries=3, timeout=SMALL_TIMEOUT)
def compose_publish_task(cfg: ComposeRunConfig, enhancer: CheckpointRef, image: CheckpointRef) -> Stacks:
    """Publish every trained stack's version (both were written before either is published)."""
    timings: dict[str, float] = {}
    with phase("publish", timings):
        refs = phases.publish_stacks(cfg, _refs(enhancer, image))
    use_storage_options(cfg)
    return Stacks(enhancer=refs["enhancer"], image=refs["image"])


class Evaluated(NamedTuple):
    metrics: dict[str, float]
    enhancements: dict[str, str]


@task(container_image=rollout_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=2, timeout=SMALL_TIMEOUT,
      **DECK)
def compose_eval_task(cfg: ComposeRunConfig, enhancer: CheckpointRef, image: CheckpointRef) -> Evaluated:
    """Greedy enhancement vs the prompt itself on fixed-noise images (``compose/evaluate.py``)."""
    metrics, texts = evaluate_compose(cfg, _refs(enhancer, image), cfg.eval)
    deck("eval", metrics_table(metrics, "eval"))
    return Evaluated(metrics=metrics, enhancements=texts)


@task(container_image=train_image, **CPU_TASK, retries=2, timeout=SMALL_TIMEOUT)
def compose_report_task(cfg: ComposeRunConfig, batch: SampleBatch, step: int, rollout: dict[str, float],
                        score: dict[str, float], train: dict[str, float], evaluation: dict[str, float],
                        enhancements: dict[str, str], after: str) -> str:
    """Step ``step``'s report page (prompt, enhanced prompt, image per sample) and the run index; logs the progress
    line. ``after``: the previous step's report (keeps the writes to the report's ``steps.json`` in step order)."""
    metrics = {**rollout, **score, **train, **evaluation, "step": float(step)}
    seconds = sum(metrics.get(f"time/{k}", 0.0) for k in ("rollout", "score", "train"))  # the tasks' own compute
    progress_logger().info(progress_line(step, cfg.loop.total_steps, metrics, seconds))
    return write_step_report(cfg, step, batch, metrics, enhancements or None)
