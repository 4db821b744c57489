"""A Ctrl-C that flytekit's local runner swallows still stops the run: no phase starts after it."""

from __future__ import annotations

import pytest

from tasks import common
from unirl_core.config import load_recipe


def test_a_swallowed_ctrl_c_stops_the_next_phase_and_says_what_was_published(tmp_path, capsys):
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "name=intr"])
    common._INTERRUPTED_RUN[:] = [cfg]
    try:
        common._on_sigint(2, None)  # what flytekit's handler calls; its SystemExit is the part that got lost
        capsys.readouterr()
        with pytest.raises(RuntimeError, match=r"interrupted \(Ctrl-C\): the publish phase was not started"):
            with common.phase("publish", {}):
                pytest.fail("a phase ran after Ctrl-C")
        assert "interrupted: run 'intr'" in capsys.readouterr().err  # said again: the message names LATEST now
        common._STOP_REQUESTED.clear()
        metrics: dict[str, float] = {}
        with common.phase("publish", metrics):
            pass
        assert "time/publish" in metrics
    finally:
        common._INTERRUPTED_RUN.clear()
        common._STOP_REQUESTED.clear()
