"""A writer killed with SIGKILL mid-checkpoint leaves the previous version intact and the partial one invisible."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from unirl_core.checkpoint import CheckpointStore

REPO = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from unirl_core.checkpoint import fsio, store as S
    root, phase = sys.argv[1], sys.argv[2]
    st = S.CheckpointStore(root, "r")
    st.save(1, weights={"w": torch.full((1 << 18,), 1.0)}, policy_version=1, train_state={"x": torch.ones(2)})
    write_local, replace = fsio.write_local, os.replace

    def park():
        print("KILLME", flush=True)
        time.sleep(120)

    def write_hook(path, pieces, **kw):
        if phase == "mid-file" and path.endswith("model.safetensors"):
            data = b"".join(bytes(p) for p in pieces)
            with open(path, "wb") as f:  # half of the payload reaches the disk, then the process dies
                f.write(data[: len(data) // 2])
                f.flush()
            park()
        if phase == "between-files" and path.endswith("train_state.pt"):
            park()
        return write_local(path, pieces, **kw)

    def replace_hook(src, dst):
        if phase == "manifest-temp" and dst.endswith("manifest.json"):
            park()
        return replace(src, dst)

    fsio.write_local = write_hook
    fsio.os.replace = replace_hook
    st.save(2, weights={"w": torch.full((1 << 18,), 2.0)}, policy_version=2, train_state={"x": torch.ones(2)})
    print("FINISHED", flush=True)
""")


@pytest.mark.parametrize("phase", ["mid-file", "between-files", "manifest-temp"])
@pytest.mark.slow
def test_sigkill_while_writing_leaves_previous_version(tmp_path, phase):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), phase], stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line == "KILLME", f"child did not reach the write ({line!r}, rc={proc.poll()})"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = tmp_path / "r" / "step-00000002"
    assert partial.is_dir() and not (partial / "manifest.json").exists()  # the kill really hit mid-write
    store = CheckpointStore(str(tmp_path), "r")
    assert [r.step for r in store.versions()] == [1]
    latest = store.latest()
    assert latest.step == 1
    got = store.load(latest)
    assert torch.equal(got.weights["w"], torch.full((1 << 18,), 1.0))
    # the next writer reuses the step cleanly
    store.save(2, weights={"w": torch.zeros(3)}, policy_version=2)
    assert store.latest().step == 2 and torch.equal(store.load().weights["w"], torch.zeros(3))
