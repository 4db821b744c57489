"""run_local's artifacts a user reads: TensorBoard scalars in the run folder and progress lines on stderr."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _cfg(root, *extra):
    return load_recipe("tiny-grpo", [f"checkpoint.root={root}", "loop.total_steps=2", *extra])


def test_tiny_grpo_writes_each_steps_metrics_as_tensorboard_scalars(tmp_path):
    hist = run_local(_cfg(tmp_path), progress=False)
    logdir = tmp_path / "tiny-grpo" / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents.") for p in logdir.iterdir())
    scalars = _scalars(logdir)
    for key in ("reward/mean", "train/loss", "train/ratio_mean", "time/step"):
        assert [s for s, _ in scalars[key]] == [1, 2], key
        assert [v for _, v in scalars[key]] == pytest.approx([h[key] for h in hist]), key
    assert "step" not in scalars  # the step is the x axis, not a metric


def test_tensorboard_switch_off_writes_no_event_files(tmp_path):
    run_local(_cfg(tmp_path, "report.tensorboard=false"), progress=False)
    assert (tmp_path / "tiny-grpo" / "step-00000002").is_dir()
    assert not (tmp_path / "tiny-grpo" / "tensorboard").exists()


def test_progress_lines_on_stderr_by_default_with_default_logging(tmp_path, capfd):
    run_local(_cfg(tmp_path, "report.tensorboard=false"))
    err = capfd.readouterr().err.splitlines()
    steps = [ln for ln in err if ln.startswith("step ") and " | reward " in ln]
    assert [ln.split(" |")[0] for ln in steps] == ["step 1/2", "step 2/2"]
    assert all("ratio 1.0000" in ln and "ETA" in ln for ln in steps)
    notes = [ln for ln in err if ln.endswith(" ...")]
    assert any("building model tiny" in ln for ln in notes) and any("restoring checkpoint step 0" in ln for ln in notes)
    assert sum("building model" in ln for ln in notes) == 1  # once, at the start of the first step
    assert err.index(next(ln for ln in err if "building model" in ln)) < err.index(steps[0])
    # the end says where the run wrote what (no TensorBoard line: it is off)
    tail = err[err.index(steps[-1]):]
    assert any(ln.startswith(f"  report:      {tmp_path}/tiny-grpo/report/index.html") for ln in tail), tail
    assert not any("TensorBoard:" in ln for ln in err)


@pytest.mark.parametrize("how", ["argument", "config"])
def test_progress_opt_out_is_silent(tmp_path, capfd, how):
    if how == "argument":
        hist = run_local(_cfg(tmp_path, "report.tensorboard=false"), progress=False)
    else:
        hist = run_local(_cfg(tmp_path, "report.tensorboard=false", "report.progress=false"))
    assert len(hist) == 2
    err = capfd.readouterr().err
    assert "step 1/2" not in err and "building model" not in err


def test_progress_argument_overrides_the_config(tmp_path, capfd):
    run_local(_cfg(tmp_path, "report.tensorboard=false", "report.progress=false"), progress=True)
    assert "step 2/2 | reward" in capfd.readouterr().err
