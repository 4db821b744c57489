"""Evaluate any published version of a run: held-out prompts, deterministic sampling, ``eval/*`` metrics.

    pyflyte run workflows/evaluate.py evaluate --recipe tiny-flow-grpo \\
        --overrides '["eval.prompts=[\\"a red fox\\"]"]' --version latest
    pyflyte run --remote workflows/evaluate.py evaluate --recipe sd35m-pickscore --version s3://.../step-00000100

Only wiring: the recipe is parsed and preflighted by ``setup_task``, the version is resolved and evaluated by
``evaluate_version_task`` (its deck shows the samples and metrics).
"""

from __future__ import annotations

from flytekit import workflow

from tasks.evaluate import evaluate_version_task
from tasks.setup import setup_task


@workflow
def evaluate(recipe: str = "tiny-flow-grpo", overrides: list[str] = [],  # noqa: B006 (flytekit copies defaults)
             version: str = "latest", weights: str = "") -> dict[str, float]:
    """``version``: ``latest`` (the run's published version) or a version folder (URI or local path);
    ``weights``: '' (``eval.weights``), ``policy`` or ``ema``."""
    setup = setup_task(recipe=recipe, overrides=overrides)
    return evaluate_version_task(cfg=setup.cfg, version=version, weights=weights)
