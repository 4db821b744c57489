"""The grpo workflow takes the run's lease at init and releases it at its end; another writer's live lease refuses
the execution before it writes anything (unirl_core/checkpoint/lease.py)."""

from __future__ import annotations

import os

import pytest

from tests.flyte.conftest import tiny_overrides
from tests.unit.checkpoint.test_lease import child, wait_line
from unirl_core.checkpoint import CheckpointStore
from unirl_core.checkpoint.lease import LeaseHeld, RunLease
from workflows.grpo import grpo


@pytest.mark.slow
def test_execution_refused_while_another_process_writes_the_run_then_releases_its_own(tmp_path, run_name):
    ov = tiny_overrides("tiny-grpo", str(tmp_path), run_name, steps=1)
    holder = child(tmp_path, run_name, "hold", 300.0)
    try:
        wait_line(holder, "HELD")
        with pytest.raises(LeaseHeld, match=f"pid {holder.pid}"):
            grpo(recipe="tiny-grpo", overrides=ov)
        assert CheckpointStore(str(tmp_path), run_name).latest() is None
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert grpo(recipe="tiny-grpo", overrides=ov).step == 1  # the killed holder's lease is taken over
    record = RunLease(str(tmp_path), run_name).holder_record()
    assert record.released and record.holder.pid == os.getpid()  # release_task ran at the execution's end
