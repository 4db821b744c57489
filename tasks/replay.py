"""Replay: rebuild steps of a stored run and check them bit for bit (``unirl_core.runs.replay``), one task.

It samples, scores and trains (one step each), so it runs on the train image with a GPU; not cached (it reads the
run's store, whose content the inputs do not name).
"""

from __future__ import annotations

import html

from flytekit import task

from images import train_image
from tasks.common import DECK, DEFAULT_ACCELERATOR, GPU_TASK, TRAIN_TIMEOUT, deck


@task(container_image=train_image, **GPU_TASK, accelerator=DEFAULT_ACCELERATOR, retries=0, timeout=TRAIN_TIMEOUT,
      **DECK)
def replay_task(run: str, steps: list[int]) -> dict[str, float]:
    """Replay each of ``steps`` of ``run`` (``<checkpoint.root>/<run name>``; an RL run, or a composed run of
    ``workflows/enhance.py``); a mismatch fails the task naming the first differing field. Returns ``replay/step_<k>_seconds`` and ``replay/steps`` (how many were equal)."""
    from unirl_core.runs.replay_compose import is_composed_run, replay_compose
    from unirl_core.runs.replay import replay

    rebuild = replay_compose if is_composed_run(run) else replay
    out, lines = {}, []
    for step in steps:
        report = rebuild(run, step=step)
        out[f"replay/step_{step}_seconds"] = report.seconds
        lines.append(report.summary())
    out["replay/steps"] = float(len(steps))
    deck("replay", "<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in lines) + "</ul>")
    return out
