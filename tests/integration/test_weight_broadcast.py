"""Trainer -> engine weight broadcast over gloo on CPU: the sender runs in the test process, the engine in
a real second process (the same code runs over NCCL on GPUs; see benchmarks/gpu_weight_sync_check.py)."""

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from unirl_core.models.lm import build_tiny_lm
from unirl_core.models.lora import apply_lora, lora_state_dict
from unirl_core.weightsync.sync import (
    WeightReceiver,
    WeightSender,
    WeightSyncConfig,
    WeightSyncError,
    WeightSyncTimeout,
    gather_for_sync,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TARGETS = ("q_proj", "v_proj")

ENGINE = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from unirl_core.models.lm import build_tiny_lm
    from unirl_core.models.lora import apply_lora
    from unirl_core.weightsync.sync import WeightReceiver, WeightSyncConfig, WeightSyncError

    out, port, scope, rank_lora, bucket_mb = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \\
        float(sys.argv[5])
    rank, num_engines = int(sys.argv[6]), int(sys.argv[7])
    torch.set_num_threads(1)
    module = build_tiny_lm(seed=7, keep_reference=False).module  # different init than the trainer
    if scope == "lora":
        apply_lora(module, rank=rank_lora, alpha=8.0, target_modules=("q_proj", "v_proj"))
    cfg = WeightSyncConfig(master_port=port, bucket_mb=bucket_mb, timeout_s=60, num_engines=num_engines)
    with WeightReceiver(cfg, module, scope=scope, rank=rank) as rx:
        while True:
            try:
                stats = rx.receive()
            except WeightSyncError as e:
                with open(out / "errors.txt", "a") as f:
                    f.write(str(e).replace("\\n", " ") + "\\n")
                continue
            if stats is None:
                break
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
            torch.save({"state": state, "version": rx.version, "buckets": stats.num_buckets}, out / f"v{stats.version}.pt")
    (out / "closed").write_text("ok")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_engine(out, port: int, scope: str, lora_rank: int, bucket_mb: float, rank: int = 1,
                  num_engines: int = 1) -> subprocess.Popen:
    script = out / "engine.py"
    script.write_text(ENGINE)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(script), str(out), str(port), scope, str(lora_rank),
                             str(bucket_mb), str(rank), str(num_engines)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> None:
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err[-4000:]


def _perturb(module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.01)


def _errors(tmp_path) -> list[str]:
    path = tmp_path / "errors.txt"
    return path.read_text().splitlines() if path.exists() else []


def test_full_weights_multiple_syncs_and_mismatches(tmp_path):
    port = _free_port()
    bucket_mb = 0.02  # 20 KiB: the 300 x 64 fp32 embedding (75 KiB) is larger than one bucket
    proc = _start_engine(tmp_path, port, "full", 0, bucket_mb)
    module = build_tiny_lm(seed=0, keep_reference=False).module
    cfg = WeightSyncConfig(master_port=port, bucket_mb=bucket_mb, timeout_s=60)
    sent = {}
    try:
        with WeightSender(cfg) as tx:
            for version in (1, 2, 3):
                _perturb(module, version)
                stats = tx.send(gather_for_sync(module, "full"), version)
                assert 1 < stats.num_buckets < stats.num_tensors
                sent[version] = ({k: v.clone() for k, v in module.state_dict().items()}, stats.num_buckets)
            good = gather_for_sync(module, "full")
            bad_name = dict(good, **{"model.extra.weight": torch.zeros(2)})
            bad_shape = dict(good, **{"model.norm.weight": torch.ones(3)})
            bad_dtype = dict(good, **{"model.norm.weight": good["model.norm.weight"].bfloat16()})
            for bad in (bad_name, bad_shape, bad_dtype):
                with pytest.raises(WeightSyncError, match="refused"):
                    tx.send(bad, 99)
            # the stream stays usable after refused headers
            _perturb(module, 4)
            tx.send(gather_for_sync(module, "full"), 4)
            tx.send(bad_dtype, 5, cast=torch.float32)  # cast while packing: accepted by the fp32 engine
    finally:
        _finish(proc)
    assert (tmp_path / "closed").exists() and not (tmp_path / "v99.pt").exists()
    errors = _errors(tmp_path)
    assert len(errors) == 3
    assert "model.extra.weight" in errors[0]
    assert "model.norm.weight" in errors[1] and "shape" in errors[1]
    assert "model.norm.weight" in errors[2] and "bfloat16" in errors[2] and "float32" in errors[2]
    sent[4] = (module.state_dict(), None)
    sent[5] = ({k: v.float() for k, v in bad_dtype.items()}, None)
    for version, (state, buckets) in sent.items():
        got = torch.load(tmp_path / f"v{version}.pt", weights_only=True)
        assert got["version"] == version and buckets in (None, got["buckets"])
        assert set(got["state"]) == set(state)
        for name, t in state.items():
            assert torch.equal(got["state"][name], t), (version, name)
    assert not torch.equal(sent[1][0]["model.norm.weight"], sent[2][0]["model.norm.weight"])


def test_lora_adapter_sync_and_rank_mismatch(tmp_path):
    port = _free_port()
    proc = _start_engine(tmp_path, port, "lora", 4, 256.0)
    module = build_tiny_lm(seed=0, keep_reference=False).module
    apply_lora(module, rank=4, alpha=8.0, target_modules=TARGETS)
    cfg = WeightSyncConfig(master_port=port, timeout_s=60)
    wrong = build_tiny_lm(seed=0, keep_reference=False).module
    apply_lora(wrong, rank=2, alpha=4.0, target_modules=TARGETS)
    try:
        with WeightSender(cfg) as tx:
            with pytest.raises(WeightSyncError, match="refused"):
                tx.send(gather_for_sync(wrong, "lora"), 1, scope="lora")
            with pytest.raises(WeightSyncError, match="refused"):  # full weights to a LoRA engine
                tx.send(gather_for_sync(module, "full"), 1, scope="full")
            for version in (1, 2):
                _perturb(module, version)  # moves lora_B off zero, so the adapter is not a no-op
                stats = tx.send(gather_for_sync(module, "lora"), version, scope="lora")
                assert stats.num_buckets == 1
    finally:
        _finish(proc)
    errors = _errors(tmp_path)
    assert len(errors) == 2 and "lora_A" in errors[0] and "shape" in errors[0] and "scope" in errors[1]
    want = lora_state_dict(module)
    for version in (1, 2):
        assert (tmp_path / f"v{version}.pt").exists()
    got = torch.load(tmp_path / "v2.pt", weights_only=True)
    engine_lora = {k.replace(".default.", "."): v for k, v in got["state"].items() if "lora_" in k}
    assert set(engine_lora) == set(want)
    for name, t in want.items():
        assert torch.equal(engine_lora[name], t), name
    # the engine's base weights are its own (seed 7), untouched by an adapter sync
    base = build_tiny_lm(seed=7, keep_reference=False).module.state_dict()
    assert torch.equal(got["state"]["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


def test_two_engines_receive_the_same_weights(tmp_path):
    port = _free_port()
    dirs = [tmp_path / f"engine{r}" for r in (1, 2)]
    procs = []
    for r, d in zip((1, 2), dirs, strict=True):
        d.mkdir()
        procs.append(_start_engine(d, port, "full", 0, 256.0, rank=r, num_engines=2))
    module = build_tiny_lm(seed=0, keep_reference=False).module
    try:
        with WeightSender(WeightSyncConfig(master_port=port, num_engines=2, timeout_s=60)) as tx:
            _perturb(module, 1)
            tx.send(gather_for_sync(module, "full"), 1)
            with pytest.raises(WeightSyncError, match="2 engine"):
                tx.send({"nope": torch.zeros(1)}, 2)
    finally:
        for proc in procs:
            _finish(proc)
    for d in dirs:
        got = torch.load(d / "v1.pt", weights_only=True)
        for name, t in module.state_dict().items():
            assert torch.equal(got["state"][name], t), (d.name, name)
        assert len(_errors(d)) == 1 and "nope" in _errors(d)[0]


def test_receiver_without_sender_times_out():
    module = build_tiny_lm(seed=0, keep_reference=False).module
    cfg = WeightSyncConfig(master_port=_free_port(), timeout_s=1.0)
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncTimeout, match="rendezvous"):
        WeightReceiver(cfg, module)
    assert time.perf_counter() - t0 < 30


STALLED = textwrap.dedent("""
    import sys, time, torch
    from unirl_core.weightsync.sync import WeightReceiver, WeightSyncConfig
    rx = WeightReceiver(WeightSyncConfig(master_port=int(sys.argv[1]), timeout_s=60), torch.nn.Linear(2, 2))
    time.sleep(60)  # joined the group, never receives
""")


def test_engine_that_stops_receiving_times_out_the_send(tmp_path):
    port = _free_port()
    script = tmp_path / "stalled.py"
    script.write_text(STALLED)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(script), str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        tx = WeightSender(WeightSyncConfig(master_port=port, timeout_s=3.0))
        t0 = time.perf_counter()
        with pytest.raises(WeightSyncTimeout, match="3.0 s"):
            tx.send({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, 1)
        assert time.perf_counter() - t0 < 30
    finally:
        proc.kill()
        proc.wait()


def test_sender_without_engine_times_out():
    cfg = WeightSyncConfig(master_port=_free_port(), timeout_s=1.0)
    with pytest.raises(WeightSyncTimeout, match="rendezvous"):
        WeightSender(cfg)
