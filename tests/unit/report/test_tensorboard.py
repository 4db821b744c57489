"""ScalarLog: TensorBoard event files in a local or remote run folder."""

from __future__ import annotations

import math

import fsspec
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from unirl_core.errors import ConfigError
from unirl_core.report.tensorboard import ScalarLog


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_numeric_metrics_become_scalars_over_the_step(tmp_path):
    with ScalarLog(str(tmp_path / "run")) as log:
        log.log(1, {"reward/mean": 0.5, "train/loss": -0.1, "step": 1.0, "note": "text", "flag": True})
        log.log(2, {"reward/mean": 0.75, "train/loss": float("nan")})
    got = _scalars(tmp_path / "run" / "tensorboard")
    assert sorted(got) == ["reward/mean", "train/loss"]
    assert got["reward/mean"] == [(1, 0.5), (2, 0.75)]
    assert got["train/loss"][0] == (1, pytest.approx(-0.1)) and math.isnan(got["train/loss"][1][1])


def test_two_writers_add_files_that_read_back_as_one_run(tmp_path):
    for step in (1, 2):  # what the Flyte report task does: one writer per step
        with ScalarLog(str(tmp_path)) as log:
            log.log(step, {"reward/mean": float(step)})
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    assert _scalars(tmp_path / "tensorboard")["reward/mean"] == [(1, 1.0), (2, 2.0)]


def test_remote_run_folder_gets_the_event_file_after_every_step(tmp_path):
    fs = fsspec.filesystem("memory")
    log = ScalarLog("memory://bucket/run")
    log.log(1, {"reward/mean": 0.25})
    names = fs.ls("/bucket/run/tensorboard", detail=False)
    assert len(names) == 1 and "events.out.tfevents." in names[0]
    log.log(2, {"reward/mean": 0.5})
    log.close()
    local = tmp_path / "tb"
    local.mkdir()
    (local / names[0].rsplit("/", 1)[1]).write_bytes(fs.cat_file(names[0]))
    assert _scalars(local)["reward/mean"] == [(1, 0.25), (2, 0.5)]
    fs.rm("/bucket", recursive=True)


def test_empty_run_uri_is_a_config_error():
    with pytest.raises(ConfigError, match="run_uri"):
        ScalarLog("")
