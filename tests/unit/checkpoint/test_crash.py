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


DELTA_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from unirl_core.checkpoint import fsio, store as S
    from unirl_core.checkpoint.delta import DELTA_FILE, DeltaVersions, WeightsMemory
    root, phase = sys.argv[1], sys.argv[2]
    st, memory = S.CheckpointStore(root, "r", encoding=DeltaVersions(8)), WeightsMemory()
    w = torch.linspace(-1, 1, 1 << 18).to(torch.bfloat16)
    for step in (1, 2):  # an anchor and a delta, published
        st.save(step, weights={"w": w + step * 0.01}, policy_version=step, memory=memory, config={"s": step})
    write_local, replace = fsio.write_local, os.replace

    def park():
        print("KILLME", flush=True)
        time.sleep(120)

    def write_hook(path, pieces, **kw):
        if phase == "mid-delta" and path.endswith(DELTA_FILE):
            data = b"".join(bytes(p) for p in pieces)
            with open(path, "wb") as f:  # half of the compressed delta reaches the disk, then the process dies
                f.write(data[: len(data) // 2])
                f.flush()
            park()
        if phase == "after-delta" and path.endswith("config.json"):
            park()
        return write_local(path, pieces, **kw)

    def replace_hook(src, dst):
        if phase == "manifest-temp" and dst.endswith("manifest.json"):
            park()
        return replace(src, dst)

    fsio.write_local = write_hook
    fsio.os.replace = replace_hook
    st.save(3, weights={"w": w + 0.03}, policy_version=3, memory=memory, config={"s": 3})
    print("FINISHED", flush=True)
""")


@pytest.mark.parametrize("phase", ["mid-delta", "after-delta", "manifest-temp"])
@pytest.mark.slow
def test_sigkill_while_writing_a_delta_leaves_latest_complete(tmp_path, phase):
    """Versions 1 (anchor) and 2 (delta) published; the writer dies writing delta 3: LATEST names 2, which reads
    back through its chain; the partial 3 is invisible and the next writer (no memory) rewrites it in full."""
    from unirl_core.checkpoint.delta import DELTA_FILE, DeltaVersions

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", DELTA_CHILD, str(tmp_path), phase], stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line == "KILLME", f"child did not reach the write ({line!r}, rc={proc.poll()})"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = tmp_path / "r" / "step-00000003"
    assert (partial / DELTA_FILE).is_file() and not (partial / "manifest.json").exists()
    store = CheckpointStore(str(tmp_path), "r", encoding=DeltaVersions(8))
    assert [r.step for r in store.versions()] == [1, 2] and store.latest().step == 2
    w = torch.linspace(-1, 1, 1 << 18).to(torch.bfloat16)
    got = store.load()
    assert got.manifest.chain == [1] and torch.equal(got.weights["w"].view(torch.int16), (w + 0.02).view(torch.int16))
    store.save(3, weights={"w": w + 0.03}, policy_version=3)
    assert store.latest().step == 3 and torch.equal(store.load().weights["w"], w + 0.03)
