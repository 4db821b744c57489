"""Export a run's version as a folder other tools load: a peft adapter, a diffusers pipeline or a transformers model.

    pyflyte run workflows/export.py export --source runs/tiny-flow-grpo --out exports/tiny-flow-grpo
    pyflyte run --remote workflows/export.py export --source s3://<bucket>/unirl/checkpoints/sd35m-pickscore \
        --out s3://<bucket>/exports/pickscore-lora --fmt peft

The same as ``python -m unirl_core.runs.export`` (docs/models.md), as a Flyte execution. Only wiring: ``export_task``
calls ``unirl_core.runs.export.export_version``.
"""

from __future__ import annotations

from flytekit import workflow

from tasks.export import export_task


@workflow
def export(source: str, out: str, fmt: str = "", ema: bool = False) -> str:
    """``source``: a version folder or a run folder (its latest version); ``out``: the folder to write; ``fmt``:
    ``peft`` | ``diffusers`` | ``transformers`` ("" picks by the run); ``ema``: export the EMA weights."""
    return export_task(source=source, out=out, fmt=fmt, ema=ema)
