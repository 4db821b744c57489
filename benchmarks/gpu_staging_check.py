"""Pinned-buffer staging of a version's weights (``HostStaging`` + ``VersionWriter``) on a GPU: correct and faster.

Qwen3-0.6B's bf16 weights (1.2 GB, 28 x 4 tensors of the real shapes' sizes, random) are staged and written
as versions 1..N on the writer's thread, the way ``save_train_checkpoint`` writes a weights-only version, while
the GPU is kept busy: a chain of large matmuls is queued before every staging (so the asynchronous copies are
still waiting when ``save`` returns) and every tensor is changed in place right after it (the next step's
optimizer update). Each written version must hold bitwise the values the tensors had when it was staged; a
reader that did not wait for the copies, or buffers reused before their write finished, would read zeros,
the previous version's values or the next step's. Timed against the synchronous pageable ``.to("cpu")`` the
train phase used before (same tensors, same run): what the train phase waits for per version.

  python benchmarks/gpu_staging_check.py             # CUDA
  OMP_NUM_THREADS=1 python benchmarks/gpu_staging_check.py --smoke   # CPU: the check's logic only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, write_record  # noqa: E402

from unirl_core.checkpoint.store import CheckpointStore, load_weights  # noqa: E402
from unirl_core.checkpoint.writer import VersionWriter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--busy-matmuls", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="CPU, 1/64 of the rows: the script's logic only")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_staging_check.py needs CUDA (--smoke runs the logic on the CPU)")
    dev = torch.device("cpu" if args.smoke else "cuda")
    div, big = (64, 256) if args.smoke else (1, 8192)
    g = torch.Generator(device=dev).manual_seed(0)
    # Qwen3-0.6B-sized: 28 layers x (q/k/v/o 1024x2048-ish + MLP 3 x 1024x3072) ~ 0.44B + embedding 151936x1024
    shapes = [(151936, 1024)] + [(3072, 1024)] * 84 + [(2048, 1024)] * 56 + [(1024, 2048)] * 28
    params = [torch.randn((s[0] // div, s[1]), generator=g, device=dev, dtype=torch.bfloat16) for s in shapes]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    busy = torch.randn(big, big, generator=g, device=dev, dtype=torch.bfloat16) / big ** 0.5

    def keep_busy() -> None:
        x = busy
        for _ in range(args.busy_matmuls):
            x = x @ busy

    root = tempfile.mkdtemp()
    store = CheckpointStore(root, "staging", keep_last=args.versions + 1)
    writer = VersionWriter()
    expected, staged_s, pageable_s, refs = {}, [], [], []
    for step in range(1, args.versions + 1):
        expected[step] = [p.clone() for p in params]  # the values version `step` must hold
        keep_busy()  # the copies below queue behind this
        writer.wait()  # the previous version's write (timed apart: it runs beside training)
        t0 = time.perf_counter()
        weights = {f"w{i}": writer.staging.copy(f"w{i}", p) for i, p in enumerate(params)}
        ref = writer.save(store, step, policy_version=step, live=params, weights=weights, meta={})
        staged_s.append(time.perf_counter() - t0)
        for p in params:  # the next step's in-place update, right behind the copies on the same stream
            p.mul_(-1.0).add_(0.5)
        writer.publish(ref)
        refs.append(ref)
        # the synchronous pageable copy it replaces (what the train phase waited for before)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        host = [p.to("cpu").contiguous() for p in params]
        pageable_s.append(time.perf_counter() - t0)
        del host
    writer.wait()
    mismatches = []
    for step, ref in zip(range(1, args.versions + 1), refs):
        got = load_weights(ref)
        for i, want in enumerate(expected[step]):
            if not torch.equal(got[f"w{i}"], want.cpu()):
                mismatches.append((step, i))
    if store.latest() is None or store.latest().step != args.versions:
        mismatches.append(("LATEST", store.latest()))
    result = {
        "bytes_per_version": nbytes, "versions": args.versions, "pinned_buffer_bytes": writer.staging.nbytes,
        "staged_save_s_median": statistics.median(staged_s[1:]), "staged_save_s_first": staged_s[0],
        "pageable_to_cpu_s_median": statistics.median(pageable_s), "bitwise_equal": not mismatches,
        "mismatches": [str(m) for m in mismatches[:10]], "hardware": environment(),
    }
    print(f"{nbytes / 2**30:.2f} GiB per version, {args.versions} versions: staged save (train-phase share) "
          f"median {result['staged_save_s_median']:.3f} s (first, with pinned allocation, "
          f"{staged_s[0]:.3f} s) vs pageable to('cpu') {result['pageable_to_cpu_s_median']:.3f} s; "
          f"every version bitwise the staged values: {not mismatches}")
    if args.smoke:  # plumbing only: no record
        print(json.dumps(result, indent=1))
    else:
        md = ("| GiB per version | versions | staged save median s | first s | pageable to('cpu') median s |\n"
              "|---|---|---|---|---|\n"
              f"| {nbytes / 2**30:.2f} | {args.versions} | {result['staged_save_s_median']:.3f} | {staged_s[0]:.3f} | "
              f"{result['pageable_to_cpu_s_median']:.3f} |")
        print(f"wrote {write_record('staging_check', result, md, env=result['hardware'])}")
    if mismatches:
        raise SystemExit(f"staged versions differ from the values at staging: {mismatches[:5]}")


if __name__ == "__main__":
    main()
