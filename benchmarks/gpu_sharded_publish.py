"""Publishing from a sharded (FSDP2) trainer to an engine: gather-to-CPU first (``gather_for_sync`` + ``send``)
vs per-bucket on the device (``sync_sources`` + ``send(train_group=True)`` / ``follow_send``).

Three processes: train ranks 0 and 1 (FSDP2 over the default group; NCCL on GPUs 0 and 1, gloo on CPU) and one
engine (GPU 2) that receives bf16 weights over the weight-sync group. The model is a stack of ``--layers``
blocks of 4 square Linear layers (``--hidden``), fp32 masters, each block sharded; the engine holds a bf16 copy.
Rank 0 reports per path: seconds per publish (median of ``--repeats``), peak extra device memory during the
publish (``torch.cuda.max_memory_allocated`` above the resident state), and the engine's checksum of what it
received vs the trainer's full state cast to bf16 (must be equal).

  python benchmarks/gpu_sharded_publish.py --device cuda --hidden 4096 --layers 18   # ~1.2B params; 3 GPUs
  OMP_NUM_THREADS=1 python benchmarks/gpu_sharded_publish.py --device cpu --hidden 256 --layers 4   # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _model(hidden: int, layers: int):
    from torch import nn

    return nn.Sequential(*[nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(4)])
                           for _ in range(layers)])


def _checksum(state) -> float:
    import torch

    return float(sum(t.detach().to("cpu", torch.float64).sum() for t in state.values()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_rank(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from unirl_core.weightsync.sync import (
        WeightSender,
        WeightSyncConfig,
        follow_send,
        gather_for_sync,
        sync_sources,
    )

    rank = int(os.environ["RANK"])
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    torch.manual_seed(0)
    module = _model(args.hidden, args.layers).to(device)
    for block in module:
        fully_shard(block)
    fully_shard(module)
    cfg = WeightSyncConfig(master_port=args.sync_port, num_engines=1, bucket_mb=args.bucket_mb, timeout_s=600)
    sender = WeightSender(cfg, device=device) if rank == 0 else None
    plan = {"bucket_bytes": cfg.bucket_bytes, "direct_bytes": cfg.direct_bytes}
    out: dict[str, dict] = {}
    version = 0
    for path in ("gather_to_cpu", "per_bucket_on_device"):
        times, peaks = [], []
        for _ in range(args.repeats):
            version += 1
            if cuda:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            dist.barrier()
            t0 = time.perf_counter()
            if path == "gather_to_cpu":
                state = gather_for_sync(module, "full")  # collective; full fp32 tensors on rank 0's CPU
                if rank == 0:
                    sender.send(state, version, cast=torch.bfloat16)
                del state
            else:
                state = sync_sources(module, "full")
                if rank == 0:
                    sender.send(state, version, cast=torch.bfloat16, train_group=True)
                else:
                    follow_send(state, cast=torch.bfloat16, verdict=torch.zeros(1, dtype=torch.int32, device=device),
                                **plan)
                del state
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated() - base)
        out[path] = {"seconds": times, "median_s": statistics.median(times),
                     "peak_extra_bytes": max(peaks) if peaks else None}
    full = gather_for_sync(module, "full")
    if rank == 0:
        sender.close()
        want = _checksum({k: v.to(torch.bfloat16) for k, v in full.items()})
        params = sum(v.numel() for v in full.values())
        Path(args.out, "train.json").write_text(json.dumps({"paths": out, "checksum": want, "params": params}))
    dist.destroy_process_group()
    os._exit(0)


def engine(args) -> None:
    import torch

    from unirl_core.weightsync.sync import WeightReceiver, WeightSyncConfig

    cuda = args.device == "cuda"
    device = torch.device("cuda", 2) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    module = _model(args.hidden, args.layers).to(device=device, dtype=torch.bfloat16)
    cfg = WeightSyncConfig(master_port=args.sync_port, num_engines=1, bucket_mb=args.bucket_mb, timeout_s=600)
    versions = []
    with WeightReceiver(cfg, module, device=device) as rx:
        while (stats := rx.receive()) is not None:
            versions.append(stats.version)
    Path(args.out, "engine.json").write_text(json.dumps({"versions": versions,
                                                         "checksum": _checksum(module.state_dict())}))
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--role", choices=("train", "engine"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--sync-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "train":
        return train_rank(args)
    if args.role == "engine":
        return engine(args)
    out = Path(tempfile.mkdtemp(prefix="unirl-sharded-publish-"))
    sync_port, master_port = _free_port(), _free_port()
    common = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--hidden", str(args.hidden),
              "--layers", str(args.layers), "--bucket-mb", str(args.bucket_mb), "--repeats", str(args.repeats),
              "--out", str(out), "--sync-port", str(sync_port)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([*common, "--role", "engine"], env=env)]
    for rank in range(2):
        procs.append(subprocess.Popen([*common, "--role", "train"], env=dict(
            env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port))))
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise SystemExit(f"a process failed: exit codes {codes}")
    train = json.loads((out / "train.json").read_text())
    eng = json.loads((out / "engine.json").read_text())
    gib = lambda n: "-" if n is None else f"{n / 2**30:.2f} GiB"
    print(f"{train['params'] / 1e9:.3f} B params, fp32 masters on 2 FSDP2 ranks -> bf16 engine ({args.device}), "
          f"bucket {args.bucket_mb:g} MiB, {args.repeats} publishes per path")
    for path, r in train["paths"].items():
        print(f"  {path:22s} median {r['median_s']:.3f} s  peak extra device memory {gib(r['peak_extra_bytes'])}")
    same = eng["checksum"] == train["checksum"]
    print(f"  engine received versions {eng['versions']}; checksum equal to the trainer's bf16 state: {same}")
    if not same:
        raise SystemExit("engine weights differ from the trainer's")


if __name__ == "__main__":
    main()
