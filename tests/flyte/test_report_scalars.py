"""The report task's TensorBoard scalars: written per step into the run folder, none when switched off."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tasks.report import write_scalars
from unirl_core.config import load_recipe


def test_write_scalars_follows_the_switch(tmp_path):
    on = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path / 'on'}"])
    for step in (1, 2):
        write_scalars(on, step, {"reward/mean": step / 4, "train/loss": -step / 10})
    acc = EventAccumulator(str(tmp_path / "on" / "tiny-grpo" / "tensorboard"))
    acc.Reload()
    # One event file per report task: TensorBoard plots by step whatever order it reads the files in.
    assert sorted((e.step, e.value) for e in acc.Scalars("reward/mean")) == [(1, 0.25), (2, 0.5)]
    off = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path / 'off'}", "report.tensorboard=false"])
    write_scalars(off, 1, {"reward/mean": 0.25})
    assert not (tmp_path / "off").exists()
