"""The run lease: one writer per run, between real processes (refuse, wait, kill -9 and takeover, expiry, races)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unirl_core.checkpoint.lease import Holder, LeaseConfig, LeaseHeld, LeaseLost, RunLease
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
CHILD = str(Path(__file__).with_name("lease_child.py"))


def child(root, run: str, mode: str, hold: float = 0.0, options: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in ("FLYTE_INTERNAL_EXECUTION_ID", "FLYTE_INTERNAL_EXECUTION_PROJECT", "FLYTE_INTERNAL_EXECUTION_DOMAIN"):
        env.pop(k, None)
    args = [sys.executable, CHILD, str(root), run, mode, str(hold)] + ([json.dumps(options)] if options else [])
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_line(proc: subprocess.Popen, want: str) -> str:
    line = proc.stdout.readline().strip()
    assert line == want, (line, proc.stderr.read() if proc.poll() is not None else "")
    return line


def elsewhere(**kw) -> Holder:
    return Holder(host="another-host", pid=4242, started=time.time(), **kw)


@pytest.mark.slow  # Python subprocesses: several seconds (docs/testing.md tiers)
def test_a_second_process_is_refused_naming_the_holder_then_takes_the_released_lease(tmp_path):
    holder = child(tmp_path, "run", "hold", 4.0)
    wait_line(holder, "HELD")
    second = child(tmp_path, "run", "acquire")
    out, _ = second.communicate(timeout=60)
    assert out.startswith("HELD-BY-OTHER"), out
    assert f"pid {holder.pid}" in out and "checkpoint.lease.on_held=wait" in out and "LEASE" in out
    assert holder.wait(timeout=60) == 0
    record = RunLease(str(tmp_path), "run").holder_record()
    assert record.released and record.holder.pid == holder.pid
    third = child(tmp_path, "run", "acquire")
    assert third.communicate(timeout=60)[0].strip() == "WON"


def test_kill_9_of_the_holder_lets_the_next_writer_take_over_with_a_warning(tmp_path, caplog):
    holder = child(tmp_path, "run", "hold", 300.0)
    wait_line(holder, "HELD")
    lease = RunLease(str(tmp_path), "run")
    assert lease.try_acquire().holder.pid == holder.pid  # alive: held
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="unirl_core.checkpoint.lease"):
        lease.acquire()
    assert f"taking over from pid {holder.pid}" in caplog.text and "is dead" in caplog.text
    record = lease.holder_record()
    assert record.holder.pid == os.getpid() and not record.released
    lease.release()


@pytest.mark.slow  # Python subprocesses: several seconds (docs/testing.md tiers)
def test_wait_mode_waits_for_the_holder_to_finish(tmp_path):
    holder = child(tmp_path, "run", "hold", 2.0)
    wait_line(holder, "HELD")
    lease = RunLease(str(tmp_path), "run", LeaseConfig(on_held="wait", wait_s=60.0, ttl_s=10.0))
    t0 = time.monotonic()
    lease.acquire()
    assert holder.wait(timeout=30) == 0 and time.monotonic() - t0 > 0.5
    assert lease.holder_record().holder.pid == os.getpid()
    short = RunLease(str(tmp_path), "run", LeaseConfig(on_held="wait", wait_s=0.3, ttl_s=10.0), holder=elsewhere())
    with pytest.raises(LeaseHeld, match="waited checkpoint.lease.wait_s"):
        short.acquire()


def test_expired_heartbeat_is_taken_over_and_the_old_writer_learns_it_lost(tmp_path, caplog):
    old = RunLease(str(tmp_path), "run", LeaseConfig(ttl_s=0.5), holder=elsewhere())
    old.acquire()
    new = RunLease(str(tmp_path), "run", LeaseConfig(ttl_s=30.0))
    assert new.try_acquire() is not None  # fresh heartbeat on another host: held
    time.sleep(0.7)
    with caplog.at_level(logging.WARNING, logger="unirl_core.checkpoint.lease"):
        new.acquire()
    assert "taking over from pid 4242 on host another-host" in caplog.text and "heartbeat" in caplog.text
    with pytest.raises(LeaseLost, match="checkpoint.lease.ttl_s"):
        old.renew()
    old.release()  # not its lease any more: leaves the new holder's record alone
    assert not new.holder_record().released
    new.renew()


def test_one_flyte_execution_is_one_writer_across_pods(tmp_path):
    pod1 = RunLease(str(tmp_path), "run", holder=Holder(host="pod-a", pid=1, execution="p:d:exec1"))
    pod2 = RunLease(str(tmp_path), "run", holder=Holder(host="pod-b", pid=1, execution="p:d:exec1"))
    other = RunLease(str(tmp_path), "run", holder=Holder(host="pod-a", pid=1, execution="p:d:exec2"))
    pod1.acquire()
    pod2.renew()  # the publish task of the same execution, in another pod
    with pytest.raises(LeaseHeld, match="Flyte execution p:d:exec1"):
        other.acquire()
    pod2.release()
    other.acquire()


@pytest.mark.slow  # Python subprocesses: several seconds (docs/testing.md tiers)
def test_racing_processes_for_a_free_lease_elect_exactly_one(tmp_path):
    procs = [child(tmp_path, "run", "try") for _ in range(6)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs.count("WON") == 1, outs
    winner = procs[outs.index("WON")].pid
    assert all(o == f"LOST {winner}" for o in outs if o != "WON"), outs


def test_a_run_folder_removed_before_the_lock_opens_is_made_again(tmp_path, monkeypatch):
    # another process's preflight probe of the same run removes the empty run folder it made, between this
    # process's makedirs and its open of the lock file
    import unirl_core.checkpoint.lease as lease_module

    real_open, removed = os.open, []

    def open_after_removal(path, *args, **kwargs):
        if not removed and str(path).endswith(".lock"):
            removed.append(str(path))
            os.rmdir(os.path.dirname(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(lease_module.os, "open", open_after_removal)
    lease = RunLease(str(tmp_path), "run", holder=elsewhere())
    lease.acquire()
    assert [os.path.dirname(p) for p in removed] == [str(tmp_path / "run")] and (tmp_path / "run").is_dir()
    lease.release()


def test_lease_config_refuses_bad_values():
    with pytest.raises(ConfigError, match="checkpoint.lease.on_held"):
        LeaseConfig(on_held="steal")
    with pytest.raises(ConfigError, match="checkpoint.lease.ttl_s"):
        LeaseConfig(ttl_s=0)
    cfg = load_recipe("tiny-grpo", ["checkpoint.lease.on_held=wait", "checkpoint.lease.ttl_s=60"])
    assert cfg.checkpoint.lease == LeaseConfig(on_held="wait", ttl_s=60)


@pytest.mark.slow
def test_run_local_refuses_a_run_another_process_writes_and_releases_its_own(tmp_path):
    from unirl_core.checkpoint import CheckpointStore
    from unirl_core.loop.local import run_local

    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=1"])
    holder = child(tmp_path, cfg.name, "hold", 300.0)
    try:
        wait_line(holder, "HELD")
        with pytest.raises(LeaseHeld, match=f"pid {holder.pid}"):
            run_local(cfg, progress=False)
        assert CheckpointStore(str(tmp_path), cfg.name).latest() is None  # refused before writing step 0
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert [h["step"] for h in run_local(cfg, progress=False)] == [1.0]  # the dead holder's lease is taken over
    record = RunLease(str(tmp_path), cfg.name).holder_record()
    assert record.released and record.holder.pid == os.getpid()
