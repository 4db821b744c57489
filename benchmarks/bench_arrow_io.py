"""Arrow IPC SampleBatch write+read vs torch.save/torch.load and pickle of the same tensors.

Batches: diffusion (48 samples x 11 latents of 16x64x64 fp32 + log-probs + 512x512 PNG media) and
AR (256 samples x ~1k tokens with log-probs). One thread (OMP_NUM_THREADS=1). Files live in the
page cache of a temp dir; each number is the median of 5 runs.

Integrity: ``write_batch`` always stores per-column CRC-32 checksums; ``read_batch`` verifies them
by default (every byte read once) and skips them with ``verify=False`` (lazy zero-copy map). Both
reads are timed, and an eager scan (sum of every tensor) after each is compared with
``torch.load(mmap=True)`` + the same scan and with ``torch.load`` + the scan.

Run: python benchmarks/bench_arrow_io.py [--quick]
"""

from __future__ import annotations

import argparse
import io
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import median_time, pin_threads, report  # noqa: E402
from unirl_core.io import batch_to_table, read_batch, write_batch  # noqa: E402
from unirl_core.io.integrity import ALGO, table_checksums  # noqa: E402
from unirl_core.io.schema import CHECKSUMMED_META  # noqa: E402
from unirl_core.types import (  # noqa: E402
    ARSamplingParams,
    DiffusionSamplingParams,
    DiffusionSegment,
    PromptRecord,
    SampleBatch,
    TokenSegment,
)


def png_512(rng: np.random.Generator) -> bytes:
    low = rng.integers(0, 255, size=(16, 16, 3), dtype=np.uint8)
    im = Image.fromarray(low).resize((512, 512), Image.BICUBIC)
    arr = np.asarray(im).astype(np.int16) + rng.integers(-8, 8, size=(512, 512, 3))
    out = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def diffusion_batch(n: int) -> SampleBatch:
    rng = np.random.default_rng(0)
    sp = DiffusionSamplingParams(sigmas=torch.linspace(1, 0, 11).tolist(), height=512, width=512)
    b = SampleBatch.from_prompts([PromptRecord(prompt_id=f"p{i}", prompt=f"a photo of object {i}")
                                  for i in range(n // 8)], samples_per_prompt=8, kind="diffusion", sampling=sp)
    media = [png_512(rng) for _ in range(4)]
    g = torch.Generator().manual_seed(0)
    for i, s in enumerate(b):
        p = s.generated
        p.segment = DiffusionSegment(latents=torch.randn(11, 16, 64, 64, generator=g), log_probs=torch.randn(10, generator=g),
                                     sigmas=torch.tensor(sp.sigmas), sde_mask=torch.ones(10, dtype=torch.bool))
        p.conditions = {"prompt_embeds": torch.randn(77, 64, generator=g), "pooled": torch.randn(64, generator=g)}
        p.media = media[i % len(media)]
    return b


def ar_batch(n: int) -> SampleBatch:
    g = torch.Generator().manual_seed(0)
    b = SampleBatch.from_prompts([PromptRecord(prompt_id=f"q{i}", prompt="What is 12*7? " * 10)
                                  for i in range(n // 8)], samples_per_prompt=8, kind="ar", sampling=ARSamplingParams())
    for s in b:
        r = int(torch.randint(700, 900, (1,), generator=g))
        s.generated.segment = TokenSegment(prompt_ids=torch.randint(0, 150000, (200,), generator=g),
                                           response_ids=torch.randint(0, 150000, (r,), generator=g),
                                           log_probs=-torch.rand(r, generator=g), response_mask=torch.ones(r, dtype=torch.bool),
                                           finish_reason="stop")
        s.generated.text = "x" * (r * 3)
    return b


def tensor_payload(b: SampleBatch) -> list[dict]:
    """The same content as plain Python: what a torch.save/pickle pipeline would ship."""
    out = []
    for s in b:
        p = s.generated
        d = {k: getattr(p.segment, k) for k in p.segment.__dataclass_fields__ if isinstance(getattr(p.segment, k), torch.Tensor)}
        d.update({f"cond.{k}": v for k, v in p.conditions.items()})
        d.update({"sample_id": s.sample_id, "prompt": p.prompt, "media": p.media, "text": p.text})
        out.append(d)
    return out


def touch(tensors) -> float:
    return float(sum(t.float().sum() for t in tensors))


def bench(name: str, batch: SampleBatch, d: Path, repeats: int) -> dict:
    payload = tensor_payload(batch)
    nbytes = sum(t.numel() * t.element_size() for p in payload for t in p.values() if isinstance(t, torch.Tensor))
    f_arrow, f_torch, f_pickle = d / f"{name}.arrow", d / f"{name}.pt", d / f"{name}.pkl"

    def arrow_tensors(b):
        return [t for s in b for t in [*vars(s.generated.segment).values(), *s.generated.conditions.values()]
                if isinstance(t, torch.Tensor)]

    def torch_tensors(pl):
        return [t for p in pl for t in p.values() if isinstance(t, torch.Tensor)]

    counter = iter(range(10**6))

    def fresh(path: Path) -> Path:
        # A new file per write, as tasks do (random upload paths); replacing one file would also time the
        # kernel freeing the old file's pages, for every format alike.
        return path.with_name(f"{next(counter)}-{path.name}")

    def pickle_write():
        with open(fresh(f_pickle), "wb") as f:
            pickle.dump(payload, f, protocol=5)

    def pickle_read():
        with open(f_pickle, "rb") as f:
            return pickle.load(f)

    write_batch(batch, f_arrow)  # the files the read timings use
    torch.save(payload, f_torch)
    with open(f_pickle, "wb") as f:
        pickle.dump(payload, f, protocol=5)
    table = batch_to_table(batch)
    t = {
        "arrow_write": median_time(lambda: write_batch(batch, fresh(f_arrow)), repeats),
        "arrow_read": median_time(lambda: read_batch(f_arrow), repeats),
        "arrow_read_noverify": median_time(lambda: read_batch(f_arrow, verify=False), repeats),
        "checksum_only": median_time(lambda: table_checksums(table, CHECKSUMMED_META), repeats),
        "torch_write": median_time(lambda: torch.save(payload, fresh(f_torch)), repeats),
        "torch_read": median_time(lambda: torch.load(f_torch, weights_only=False), repeats),
        "pickle_write": median_time(pickle_write, repeats),
        "pickle_read": median_time(pickle_read, repeats),
        "arrow_read_scan": median_time(lambda: touch(arrow_tensors(read_batch(f_arrow))), repeats),
        "arrow_read_noverify_scan": median_time(lambda: touch(arrow_tensors(read_batch(f_arrow, verify=False))),
                                                repeats),
        "torch_read_scan": median_time(lambda: touch(torch_tensors(torch.load(f_torch, weights_only=False))), repeats),
        "torch_mmap_read_scan": median_time(
            lambda: touch(torch_tensors(torch.load(f_torch, weights_only=False, mmap=True))), repeats),
        "memcpy": median_time(lambda: [t.clone() for t in torch_tensors(payload)], repeats),
    }
    got = read_batch(f_arrow)
    import mmap  # noqa: F401  (addresses below come from the mapped file)
    with open("/proc/self/maps") as fm:
        maps = [ln.split() for ln in fm]
    mapped = [(int(m[0].split("-")[0], 16), int(m[0].split("-")[1], 16)) for m in maps if m[-1] == str(f_arrow)]
    inside = all(any(lo <= x.data_ptr() < hi for lo, hi in mapped) for x in arrow_tensors(got))
    t.update({
        "tensor_bytes": nbytes, "file_bytes": f_arrow.stat().st_size, "checksum_algo": ALGO,
        "roundtrip_speedup_vs_torch": (t["torch_write"] + t["torch_read"]) / (t["arrow_write"] + t["arrow_read"]),
        "roundtrip_speedup_vs_torch_noverify": (t["torch_write"] + t["torch_read"])
        / (t["arrow_write"] + t["arrow_read_noverify"]),
        "checksum_gbps": f_arrow.stat().st_size / t["checksum_only"] / 1e9,
        "roundtrip_speedup_vs_pickle": (t["pickle_write"] + t["pickle_read"]) / (t["arrow_write"] + t["arrow_read"]),
        "read_gbps": nbytes / t["arrow_read"] / 1e9, "memcpy_gbps": nbytes / t["memcpy"] / 1e9,
        "all_tensor_addresses_inside_mapped_file": inside,
    })
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small batches (smoke test)")
    args = ap.parse_args()
    pin_threads(1)
    n_diff, n_ar, reps = (8, 16, 2) if args.quick else (48, 256, 5)
    with tempfile.TemporaryDirectory() as tmp:
        res = {"diffusion": bench("diffusion", diffusion_batch(n_diff), Path(tmp), reps),
               "ar": bench("ar", ar_batch(n_ar), Path(tmp), reps)}
    rows = []
    for k, r in res.items():
        rows.append([k, f"{r['tensor_bytes'] / 1e6:.0f} MB",
                     f"{r['arrow_write'] * 1e3:.0f}/{r['arrow_read'] * 1e3:.1f}/{r['arrow_read_noverify'] * 1e3:.1f}",
                     f"{r['torch_write'] * 1e3:.0f}/{r['torch_read'] * 1e3:.0f}",
                     f"{r['pickle_write'] * 1e3:.0f}/{r['pickle_read'] * 1e3:.0f}",
                     f"{r['roundtrip_speedup_vs_torch']:.2f}x ({r['roundtrip_speedup_vs_torch_noverify']:.2f}x)",
                     f"{r['roundtrip_speedup_vs_pickle']:.2f}x",
                     f"{r['checksum_only'] * 1e3:.0f} ({r['checksum_gbps']:.1f} GB/s)",
                     r["all_tensor_addresses_inside_mapped_file"],
                     f"{r['arrow_read_scan'] * 1e3:.0f}/{r['arrow_read_noverify_scan'] * 1e3:.0f}",
                     f"{r['torch_mmap_read_scan'] * 1e3:.0f}/{r['torch_read_scan'] * 1e3:.0f}"])
    header = ["batch", "tensors", "arrow w / r verified / r unverified ms", "torch.save/load ms", "pickle w/r ms",
              "round trip vs torch (unverified)", "vs pickle", "checksum pass ms", "zero-copy (addr in mmap)",
              "read+scan ms arrow verified/unverified", "read+scan ms torch mmap/load"]
    notes = (f"Round trip = write + read; the Arrow write always computes the per-column checksums ({ALGO}; CRC-32 "
             "when xxhash is not installed), the verified read (the default) checks them, touching every byte of the "
             "file once; "
             "the unverified read (`verify=False`) maps the file lazily. 'checksum pass' = computing every column's "
             "checksum of the in-memory table once (the write-side cost; the read side hashes the same bytes). "
             "'read+scan' sums every tensor after the read (page faults included); torch mmap = "
             "`torch.load(mmap=True)` + the same scan. Every write goes to a new file (as tasks write to fresh "
             "upload paths), in the page cache of a temp dir.")
    report("arrow_io", "Arrow IPC SampleBatch vs torch.save / pickle", header, rows, res, notes)


if __name__ == "__main__":
    main()
