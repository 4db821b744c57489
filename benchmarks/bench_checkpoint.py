"""Checkpoint store throughput (local disk and a real S3 server) and LoRA adapter publish + load latency.

Baselines measured in the same run on the same tensors: a plain ``safetensors`` write/read of one file
(local) and one PUT/GET of the same bytes (S3) - what a loop without manifests or checksums would do.
The store adds sha256 of every file, fsync (local), a manifest, the LATEST pointer and retention.
S3 is the Ceph RGW from scripts/s3_server.sh (UNIRL_S3_ENDPOINT reuses a running one). OMP_NUM_THREADS=1.

Run: python benchmarks/bench_checkpoint.py [--full-mb 256] [--no-s3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import median_time, pin_threads, report  # noqa: E402


def full_weights(total_mb: int) -> dict:
    """fp32 matrices of 4 MB each up to ~total_mb (a full fine-tune's state dict)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(max(1, total_mb // 4))}


def lora_adapter(layers: int = 24, d: int = 2048, rank: int = 16) -> dict:
    """A rank-16 adapter on q/k/v/o of a 24-layer d=2048 model: ~12 MB of fp32."""
    import torch

    g = torch.Generator().manual_seed(1)
    out = {}
    for i in range(layers):
        for proj in ("q", "k", "v", "o"):
            out[f"layers.{i}.{proj}.lora_A.weight"] = torch.randn(rank, d, generator=g)
            out[f"layers.{i}.{proj}.lora_B.weight"] = torch.randn(d, rank, generator=g)
    return out


def nbytes(t: dict) -> int:
    return sum(v.numel() * v.element_size() for v in t.values())


def s3_env() -> tuple[dict, bool]:
    if os.environ.get("UNIRL_S3_ENDPOINT"):
        return {"endpoint_url": os.environ["UNIRL_S3_ENDPOINT"], "key": os.environ["AWS_ACCESS_KEY_ID"],
                "secret": os.environ["AWS_SECRET_ACCESS_KEY"]}, False
    out = subprocess.run(["bash", str(REPO / "scripts" / "s3_server.sh"), "start"], capture_output=True, text=True,
                         check=True).stdout
    env = dict(line[len("export "):].split("=", 1) for line in out.splitlines() if line.startswith("export "))
    return {"endpoint_url": env["UNIRL_S3_ENDPOINT"], "key": env["AWS_ACCESS_KEY_ID"],
            "secret": env["AWS_SECRET_ACCESS_KEY"]}, True


def bench_target(label: str, root: str, opts: dict, weights: dict, adapter: dict, repeats: int) -> list[dict]:
    import fsspec
    import safetensors.torch

    from unirl_core.checkpoint import CheckpointStore, load_checkpoint, load_weights

    store = CheckpointStore(root, "bench", keep_last=1, storage_options=opts)
    fs, base = fsspec.core.url_to_fs(root, **opts)
    raw_path = base.rstrip("/") + "/raw/model.safetensors"
    fs.makedirs(base.rstrip("/") + "/raw", exist_ok=True)
    size = nbytes(weights)

    def raw_write():
        if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
            safetensors.torch.save_file(weights, raw_path)
        else:
            fs.pipe_file(raw_path, safetensors.torch.save(weights))

    def raw_read():
        if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
            with open(raw_path, "rb") as f:
                safetensors.torch.load(f.read())
        else:
            safetensors.torch.load(fs.cat_file(raw_path))

    # Interleaved rounds so load from other processes on the box hits store and baseline alike.
    step = iter(range(1, 10_000))
    ops = {"raw_w": raw_write, "raw_r": raw_read,
           "store_w": lambda: store.save(next(step), weights=weights, policy_version=0),
           "store_r": lambda: load_checkpoint(store.latest(), storage_options=opts)}
    times = {k: [] for k in ops}
    for _ in range(repeats + 1):
        for k, fn in ops.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    t_raw_w, t_raw_r, t_w, t_r = (statistics.median(times[k][1:]) for k in ("raw_w", "raw_r", "store_w", "store_r"))

    lora_store = CheckpointStore(root, "bench-lora", keep_last=2, storage_options=opts)
    lstep = iter(range(1, 10_000))

    def publish_and_load():
        lora_store.save(next(lstep), weights=adapter, policy_version=0)  # save + manifest + LATEST + retention
        load_weights(lora_store.latest(), storage_options=opts)  # what a rollout worker does after publish

    t_lora = median_time(publish_and_load, repeats=max(5, repeats))
    fs.rm(base.rstrip("/") + "/raw", recursive=True)
    gbs = lambda t: size / t / 1e9  # noqa: E731
    return [
        {"target": label, "op": "write", "bytes": size, "store_s": t_w, "raw_s": t_raw_w, "store_gbps": gbs(t_w),
         "raw_gbps": gbs(t_raw_w), "ratio": t_raw_w / t_w},
        {"target": label, "op": "read+verify", "bytes": size, "store_s": t_r, "raw_s": t_raw_r,
         "store_gbps": gbs(t_r), "raw_gbps": gbs(t_raw_r), "ratio": t_raw_r / t_r},
        {"target": label, "op": "LoRA publish+load", "bytes": nbytes(adapter), "store_s": t_lora},
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    pin_threads(1)
    weights, adapter = full_weights(args.full_mb), lora_adapter()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        results += bench_target("local", tmp, {}, weights, adapter, args.repeats)
    if not args.no_s3:
        import s3fs

        opts, started = s3_env()
        fs = s3fs.S3FileSystem(**opts)
        bucket = "unirl-bench-ckpt"
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        try:
            results += bench_target("S3 (Ceph RGW, 127.0.0.1)", f"s3://{bucket}", opts, weights, adapter,
                                    args.repeats)
        finally:
            fs.rm(bucket, recursive=True)
            if started:
                subprocess.run(["bash", str(REPO / "scripts" / "s3_server.sh"), "stop"], capture_output=True)
    rows = []
    for r in results:
        if r["op"] == "LoRA publish+load":
            rows.append([r["target"], r["op"], f"{r['bytes'] / 1e6:.1f} MB", f"{r['store_s'] * 1e3:.0f} ms", "", ""])
        else:
            rows.append([r["target"], r["op"], f"{r['bytes'] / 1e6:.0f} MB", f"{r['store_gbps']:.2f} GB/s",
                         f"{r['raw_gbps']:.2f} GB/s", f"{r['ratio']:.2f}"])
    report("checkpoint", "Checkpoint store: throughput and LoRA publish latency",
           ["target", "operation", "payload", "store", "raw baseline", "store/raw"], rows, {"rows": results},
           notes="Store = safetensors + sha256 of every file + manifest written last + LATEST pointer + retention "
                 "(+ fsync locally); raw = one plain safetensors file write/read (S3: one PUT/GET) of the same "
                 f"tensors. Medians of {args.repeats} interleaved rounds after one warm-up (LoRA: >= 5). The memstore S3 server and the benchmark "
                 "share the same 2 cores. OMP_NUM_THREADS=1.")


if __name__ == "__main__":
    main()
