"""One step's weights version written to the local store: the synchronous write a pool train task waits for.

A Flyte train task in pool mode returns a complete version, so the trainer actor writes each step's weights
(Qwen3-0.6B full fine-tune: 1.2 GB of bf16) before the task returns. Measured here, same run, alternating:

- ``before``: the path as it was: each device tensor copied to fresh pageable host memory (``.to("cpu")``),
  then ``CheckpointStore.save`` hashing each piece inline before writing it (hash + write in a row);
- ``after``: the path as shipped: the tensors staged into reused pinned buffers (``HostStaging``, the actor's
  writer), then ``CheckpointStore.save`` with ``StreamHash`` hashing each piece on a helper thread beside its
  write (``max(hash, write)``);
- components on the same bytes: sha256 alone, the write alone (no hash; into the page cache, then its fsync),
  the host copy alone.

Every version is read back and verified (``store.load``: size + sha256). CPU tensors skip the copy (both
modes take the same path there). ``--shape tiny`` is a quick CPU check, not a result.

    python benchmarks/bench_version_write.py --device cuda --root /path/on/the/store/disk
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import pin_threads, report  # noqa: E402


def qwen3_shapes(layers: int = 28, hidden: int = 1024, heads: int = 16, kv: int = 8, head_dim: int = 128,
                 mlp: int = 3072, vocab: int = 151_936) -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's parameter shapes (tied embedding): ~596M parameters."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
                    p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
                    p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                    p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
                    p + "mlp.gate_proj.weight": (mlp, hidden), p + "mlp.up_proj.weight": (mlp, hidden),
                    p + "mlp.down_proj.weight": (hidden, mlp),
                    p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    return out


def build(shape: str, device: str) -> dict:
    import torch

    shapes = qwen3_shapes() if shape == "qwen3-0.6b" else qwen3_shapes(layers=2, hidden=64, heads=4, kv=2,
                                                                        head_dim=16, mlp=192, vocab=4096)
    g = torch.Generator(device=device).manual_seed(0)
    return {k: torch.randn(s, generator=g, device=device, dtype=torch.bfloat16) for k, s in shapes.items()}


def host_pageable(weights: dict) -> dict:
    return {k: t.detach().to("cpu").contiguous() for k, t in weights.items()}


def host_staged(weights: dict, staging) -> dict:
    from unirl_core.checkpoint.host_staging import wait_all

    out = {k: staging.copy(k, t) for k, t in weights.items()}
    wait_all(staging.fence())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("qwen3-0.6b", "tiny"), default="qwen3-0.6b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--root", default=None, help="the store's directory (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--name", default="")
    a = ap.parse_args()
    pin_threads(1)
    import torch

    from unirl_core.checkpoint import CheckpointStore, fsio
    from unirl_core.checkpoint.host_staging import HostStaging

    root = tempfile.mkdtemp(prefix="unirl-vw-", dir=a.root)
    store = CheckpointStore(root, "bench", keep_last=2)
    weights = build(a.shape, a.device)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    staging = HostStaging()
    host_staged(weights, staging)  # the first version allocates the pinned buffers (once per actor): not timed
    ahead = fsio.HASH_AHEAD
    times: dict[str, list[float]] = {k: [] for k in ("before", "after", "host_pageable", "host_staged",
                                                     "sha256", "write_fsync", "write_page_cache", "fsync")}
    step = 0
    for _ in range(a.repeats):
        for mode in ("before", "after"):
            step += 1
            fsio.HASH_AHEAD = 1 << 62 if mode == "before" else ahead  # before: every piece hashed inline
            try:
                if a.device != "cpu":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                host = host_pageable(weights) if mode == "before" else host_staged(weights, staging)
                t1 = time.perf_counter()
                ref = store.save(step, weights=host, policy_version=step)
                t2 = time.perf_counter()
            finally:
                fsio.HASH_AHEAD = ahead
            times[mode].append(t2 - t0)
            times["host_" + ("pageable" if mode == "before" else "staged")].append(t1 - t0)
            got = store.load(ref)  # size + sha256 verified on read
            assert all(torch.equal(got.weights[k], host[k]) for k in host), f"version {step} reads back different"
        from unirl_core.checkpoint import tensorfile

        header, ordered = tensorfile.encode(host, {"format": "pt"})
        pieces = list(tensorfile.chunks(header, ordered))
        t0 = time.perf_counter()
        h = hashlib.sha256()
        for p in pieces:
            h.update(p)
        times["sha256"].append(time.perf_counter() - t0)
        path = os.path.join(root, "raw.bin")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for p in pieces:
                f.write(p)
            f.flush()
            t1 = time.perf_counter()
            os.fsync(f.fileno())
        times["write_fsync"].append(time.perf_counter() - t0)
        times["write_page_cache"].append(t1 - t0)
        times["fsync"].append(time.perf_counter() - t1)
        os.remove(path)

    shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    pairs = [x / y for x, y in zip(times["after"], times["before"])]
    gb = nbytes / 1e9
    rows = [[k, f"{v:.3f}", f"{gb / v:.2f}" if v > 0 else "-"] for k, v in med.items()]
    rows.append(["after / before (median of pairs)", f"{statistics.median(pairs):.3f}x", "-"])
    report("version_write",
           f"One step's weights version, {gb:.2f} GB of bf16, written synchronously ({a.device}; "
           f"{a.repeats} repeats, median s)",
           ["what", "median s", "GB/s"], rows,
           {"shape": a.shape, "device": a.device, "bytes": nbytes, "times": times, "medians": med,
            "median_pair_ratio_after_vs_before": statistics.median(pairs)},
           notes="before = pageable host copy + inline sha256; after = pinned staging + sha256 beside the write", cell=f"{a.shape}_{a.device}{'_' + a.name if a.name else ''}")


if __name__ == "__main__":
    main()
