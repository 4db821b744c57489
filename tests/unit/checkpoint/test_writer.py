"""VersionWriter: versions written on a background thread; LATEST moves only after the manifest, failures surface."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from unirl_core.checkpoint import CheckpointStore
from unirl_core.checkpoint.writer import VersionWriter, snapshot, storages
from unirl_core.errors import CheckpointError

REPO = Path(__file__).resolve().parents[3]


def _state(value: float) -> dict:
    return {"optimizer": {"state": {"w": {"exp_avg": torch.full((4,), value)}}, "param_groups": [{"lr": 0.1}]},
            "counters": {"step": int(value)}}


def test_background_write_snapshots_then_publishes(tmp_path):
    torch.set_num_threads(1)
    store, writer = CheckpointStore(str(tmp_path), "r"), VersionWriter()
    w = torch.full((1 << 16,), 1.0)
    state = _state(1.0)
    moment = state["optimizer"]["state"]["w"]["exp_avg"]
    ref = writer.save(store, 1, policy_version=1, live=[w, moment[1:]], weights={"w": w}, train_state=state,
                      config={"lr": 0.1}, extra={"tracker": {"a": 1}})  # a view names its whole storage
    assert ref == store.ref_for(1, 1) and writer.pending(ref)
    w.add_(1.0)  # the trainer's next step changes its tensors while the version is written
    state["optimizer"]["state"]["w"]["exp_avg"].add_(1.0)
    state["counters"]["step"] = 99
    assert writer.publish(ref)
    writer.wait()
    assert not writer.pending(ref) and writer.last_seconds > 0
    assert store.latest() == ref
    got = store.load(ref)
    assert torch.equal(got.weights["w"], torch.full((1 << 16,), 1.0))  # the snapshot, not the changed tensor
    assert torch.equal(got.train_state["optimizer"]["state"]["w"]["exp_avg"], torch.full((4,), 1.0))
    assert got.train_state["counters"]["step"] == 1 and got.extra == {"tracker": {"a": 1}}
    assert writer.last_written() == (ref, store.load(ref).manifest.files)


def test_snapshot_copies_only_what_training_changes():
    live, host_copy = torch.ones(4), torch.zeros(4)
    got = snapshot({"a": [live[2:]], "b": (host_copy,), "n": 3}, storages([live]))
    assert got["a"][0].untyped_storage().data_ptr() != live.untyped_storage().data_ptr()
    assert got["b"][0] is not host_copy and got["b"][0].untyped_storage().data_ptr() == host_copy.untyped_storage().data_ptr()
    assert got["n"] == 3 and torch.equal(got["a"][0], live[2:])


def test_publish_of_a_finished_write_happens_at_once(tmp_path):
    store, writer = CheckpointStore(str(tmp_path), "r"), VersionWriter()
    ref = writer.save(store, 1, policy_version=1, live=[], weights={"w": torch.ones(3)})
    writer._write.done.wait()  # the write is done before publish is asked for
    assert writer.publish(ref) and store.latest() == ref
    assert not writer.publish(store.ref_for(7, 7))  # not this writer's write: the caller publishes


def test_a_failed_write_surfaces_naming_the_version_and_latest_stays(tmp_path):
    store, writer = CheckpointStore(str(tmp_path), "r"), VersionWriter()
    store.save(1, weights={"w": torch.ones(3)}, policy_version=1)
    ref = writer.save(store, 2, policy_version=2, live=[], weights={"w": torch.zeros(3)},
                      extra={"loss": float("nan")})  # not JSON: fails on the writer thread
    assert writer.publish(ref)  # asked while in flight: never happens, the save failed
    with pytest.raises(CheckpointError, match=r"step-00000002.*writing failed in the background.*extra"):
        writer.save(store, 3, policy_version=3, live=[], weights={"w": torch.zeros(3)})
    assert store.latest().step == 1 and [r.step for r in store.versions()] == [1]
    writer.wait()  # the error was raised once; the writer is usable again
    ref = writer.save(store, 2, policy_version=2, live=[], weights={"w": torch.zeros(3)})
    writer.publish(ref)
    writer.wait()
    assert store.latest().step == 2


def test_a_storage_error_on_the_writer_thread_names_the_version(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")  # the store root lies under a regular file: every write fails with an OSError
    store, writer = CheckpointStore(str(blocker / "root"), "r"), VersionWriter()
    ref = writer.save(store, 4, policy_version=4, live=[], weights={"w": torch.ones(3)})
    writer.publish(ref)
    with pytest.raises(CheckpointError, match=r"step-00000004.*writing failed.*(NotADirectory|FileExists)"):
        writer.wait()


CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from unirl_core.checkpoint import fsio, store as S
    from unirl_core.checkpoint.writer import VersionWriter
    st = S.CheckpointStore(sys.argv[1], "r")
    st.save(1, weights={"w": torch.full((1 << 18,), 1.0)}, policy_version=1, train_state={"x": torch.ones(2)})
    write_local = fsio.write_local

    def parked(path, pieces, **kw):
        if path.endswith("train_state.pt"):  # weights written, state and manifest not yet
            os.write(1, b"WRITER-PARKED\\n")  # one write: the two threads' lines do not interleave
            time.sleep(120)
        return write_local(path, pieces, **kw)

    fsio.write_local = parked
    writer = VersionWriter()
    ref = writer.save(st, 2, policy_version=2, live=[], weights={"w": torch.full((1 << 18,), 2.0)},
                      train_state={"x": torch.ones(2)})
    writer.publish(ref)
    x = torch.ones(64, 64)
    for _ in range(50):  # training goes on while the version is written
        x = x @ x / 64
    os.write(1, b"TRAINING-CONTINUED\\n")
    time.sleep(120)
""")


@pytest.mark.slow
def test_kill_during_a_background_write_leaves_latest_on_the_previous_version(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        lines = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
        assert lines == {"WRITER-PARKED", "TRAINING-CONTINUED"}, (lines, proc.poll())
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = tmp_path / "r" / "step-00000002"
    assert (partial / "model.safetensors").is_file() and not (partial / "manifest.json").exists()
    store = CheckpointStore(str(tmp_path), "r")
    assert store.latest().step == 1 and [r.step for r in store.versions()] == [1]
    assert torch.equal(store.load().weights["w"], torch.full((1 << 18,), 1.0))


def test_a_chore_runs_after_the_queued_write_and_its_failure_is_logged(tmp_path, caplog):
    store, writer = CheckpointStore(str(tmp_path), "r", keep_last=1), VersionWriter()
    for step in (1, 2):
        store.save(step, weights={"w": torch.ones(3)}, policy_version=step, publish=False)
    ref = writer.save(store, 3, policy_version=3, live=[], weights={"w": torch.ones(3)})
    seen = []
    writer.later(lambda: seen.append([r.step for r in store.versions()]), "look")  # queued behind version 3's write
    writer.wait_chores()
    assert seen == [[1, 2, 3]]
    writer.wait()
    store.publish(ref, retention=False)  # the pointer moves; old versions stay until a retention runs
    assert store.latest() == ref and [r.step for r in store.versions()] == [1, 2, 3]
    writer.later(store.apply_retention, "retention")
    writer.wait_chores()
    assert [r.step for r in store.versions()] == [3]

    def broken():
        raise OSError("read-only file system")

    writer.later(broken, "retention of run 'r'")
    writer.wait_chores()  # best effort: logged, not raised
    assert "retention of run 'r' failed in the background: OSError: read-only file system" in caplog.text


def test_a_forked_child_saves_with_the_parents_writer_and_store(tmp_path):
    """The parent's writer, hashing and fsync threads exist before the fork; a child inherits their executors but not
    their threads. Its saves (background and synchronous) must still finish, in threads of its own."""
    import time

    store, writer = CheckpointStore(str(tmp_path), "r"), VersionWriter()
    weights = {"a": torch.ones(1 << 10), "b": torch.zeros(1 << 10)}
    writer.save(store, 1, policy_version=1, live=[], weights=weights, train_state=_state(1.0), config={"x": 1})
    writer.wait()
    store.save(2, policy_version=2, weights=weights, train_state=_state(2.0), config={"x": 2})  # the sync pools too
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when both saves completed
        code = 1
        try:
            writer.save(store, 3, policy_version=3, live=[], weights=weights, train_state=_state(3.0), config={"x": 3})
            writer.wait()
            store.save(4, policy_version=4, weights=weights, train_state=_state(4.0), config={"x": 4})
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("a forked child's checkpoint save hung (threads of the parent's pools)")
    assert os.waitstatus_to_exitcode(status) == 0
    assert [v.step for v in store.versions()][-2:] == [3, 4]
