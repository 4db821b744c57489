"""Publishing from a sharded (FSDP2) trainer: 2 train ranks + 1 engine, real processes over gloo (NCCL on GPUs).

Rank 0 streams DTensor shards bucket by bucket (``full_tensor`` on the module's device, cast to the engine's
dtype, broadcast, freed), rank 1 follows the same gathers; nothing is copied to the CPU first. The engine ends
with exactly the bf16 rounding of the trainer's full weights; an engine of another dtype refuses the header
naming the tensor, and both train ranks stop instead of hanging."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

TRAIN = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from unirl_core.models.lm import build_tiny_lm
    from unirl_core.weightsync.sync import (WeightSender, WeightSyncConfig, WeightSyncError, follow_send,
                                              gather_for_sync, sync_sources)

    out, sync_port, deltas = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    module = build_tiny_lm(seed=0, keep_reference=False).module.float()
    for layer in module.model.layers:
        fully_shard(layer)
    fully_shard(module)
    state = sync_sources(module, "full")
    sharded = sum(type(t).__name__ == "DTensor" for t in state.values())
    cfg = WeightSyncConfig(master_port=sync_port, num_engines=1, bucket_mb=0.05, direct_mb=0.02, timeout_s=60)
    plan = dict(bucket_bytes=cfg.bucket_bytes, direct_bytes=cfg.direct_bytes, deltas=deltas)
    result = {"sharded": sharded, "tensors": len(state)}
    if rank == 0:
        sender = WeightSender(cfg, deltas=deltas)
        stats = sender.send(state, 1, cast=torch.bfloat16, train_group=True)
        result["buckets"], result["bytes"] = stats.num_buckets, stats.bytes
        if deltas:  # the same weights again: a delta of nothing changed
            again = sender.send(state, 2, cast=torch.bfloat16, train_group=True)
            result["again"] = (again.delta, again.bytes)
        try:
            sender.send(state, 2, train_group=True)  # fp32 to a bf16 engine: refused
        except WeightSyncError as e:
            result["refused"] = str(e)
        sender.close()
    else:
        follow_send(state, cast=torch.bfloat16, verdict=torch.zeros(1, dtype=torch.int32), **plan)
        if deltas:
            follow_send(state, cast=torch.bfloat16, verdict=torch.zeros(1, dtype=torch.int32), **plan)
        follow_send(state, verdict=torch.zeros(1, dtype=torch.int32), **plan)
        result["follower_done"] = True
    full = gather_for_sync(module, "full")  # the reference: the whole state on rank 0's CPU
    if rank == 0:
        result["full"] = {k: v.to(torch.bfloat16) for k, v in full.items()}
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13's gloo teardown can abort at interpreter exit (unirl_core/train/README.md)
""")

ENGINE = textwrap.dedent("""
    import os, sys, torch
    from unirl_core.models.lm import build_tiny_lm
    from unirl_core.weightsync.sync import WeightReceiver, WeightSyncConfig, WeightSyncError

    out, sync_port = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    module = build_tiny_lm(seed=7, keep_reference=False).module.to(torch.bfloat16)
    cfg = WeightSyncConfig(master_port=sync_port, num_engines=1, bucket_mb=0.05, direct_mb=0.02, timeout_s=60)
    errors, versions = [], []
    with WeightReceiver(cfg, module, scope="full") as rx:
        while True:
            try:
                stats = rx.receive()
            except WeightSyncError as e:
                errors.append(str(e))
                continue
            if stats is None:
                break
            versions.append(rx.version)
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save({"state": state, "versions": versions, "errors": errors}, f"{out}/engine.pt")
    os._exit(0)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("deltas", [False, True])
def test_sharded_trainer_publishes_bucket_by_bucket(tmp_path, deltas):
    """``deltas``: the sender keeps what it sent (rank 1 follows its gather-everything-first order) and sends the
    unchanged weights again as an empty delta."""
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "engine.py").write_text(ENGINE)
    sync_port, master_port = _free_port(), _free_port()
    base = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "engine.py"), str(tmp_path), str(sync_port)],
                              env=base, stderr=subprocess.PIPE, text=True)]
    for rank in range(2):
        env = dict(base, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(master_port))
        procs.append(subprocess.Popen([sys.executable, str(tmp_path / "train.py"), str(tmp_path), str(sync_port),
                                       str(int(deltas))], env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    engine = torch.load(tmp_path / "engine.pt")
    assert r0["sharded"] > 0 and r0["sharded"] == r1["sharded"] and r1["follower_done"]
    if not deltas:
        assert r0["buckets"] > 3  # several buckets, each gathered when it is packed
    assert engine["versions"] == ([1, 2] if deltas else [1])
    if deltas:
        assert r0["again"] == (True, 0)
    full, got = r0["full"], engine["state"]
    assert full.keys() == got.keys() and all(torch.equal(full[k], got[k]) for k in full)
    assert r0["bytes"] == sum(v.numel() * 2 for v in full.values())
    # the refusal names the tensor and the dtypes, on the engine; the trainer is told how many refused
    assert len(engine["errors"]) == 1 and "dtype='float32': expected bfloat16 (engine)" in engine["errors"][0]
    assert "weight_sync.tensors['" in engine["errors"][0]
    assert "1 engine(s) refused it" in r0["refused"]
