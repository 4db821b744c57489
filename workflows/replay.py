"""Replay steps of a stored run bit for bit: version k-1, the recipe of step k and its stored batch in, the same
batch, rewards, advantages and version k out - or a failure naming the first field that differs.

    pyflyte run workflows/replay.py replay --run runs/tiny-flow-grpo --steps '[1, 2, 4]'

The run must have been trained with ``checkpoint.keep_batches: true`` and keep the versions around each step
(``checkpoint.keep_every: 1``). Only wiring: ``replay_task`` calls ``unirl_core.runs.replay.replay``.
"""

from __future__ import annotations

from flytekit import workflow

from tasks.replay import replay_task


@workflow
def replay(run: str, steps: list[int]) -> dict[str, float]:
    """``run``: the run folder (``<checkpoint.root>/<run name>``, a path or an ``s3://`` URL); ``steps``: the steps
    to rebuild and check."""
    return replay_task(run=run, steps=steps)
