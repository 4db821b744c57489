"""Damage fuzzing of SampleBatch files: truncations, single-byte flips across the whole file, foreign files.

Every read runs in a spawned worker process, so a crash (segfault) or a hang fails the test with the
case that caused it instead of killing pytest. With verification on (the default) the contract is:
no crash, no hang, every failure a ``SchemaError`` naming the file, and a damaged file that still
reads is equal to the original in every field (tensors bitwise). Flips that legitimately read back
equal are those in bytes nothing reads or that no value depends on: padding between buffers, the
leading copy of the schema (the reader uses the footer's copy), nullable flags, unused
flatbuffer bytes, and a damaged ``unirl.`` prefix of the checksum key (the file then reads
unverified, with a warning, and its data is intact).

With ``verify=False`` the contract is weaker and tested on a subset: no crash, only ``SchemaError``;
changed values inside tensor bytes (and other values no validation can judge) may read back silently.

Seeded; about 1,500 cases, ~20-40 s on one core.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import random
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

SEED = 20240611
CASE_TIMEOUT_S = 20.0
FLIPS_PER_COLUMN = 60
FLIPS_OTHER = 1500
TRUNCATIONS = 300
VERIFY_OFF_EVERY = 3  # every 3rd flip is also read with verify=False


def _png(rng: np.random.Generator, size: int = 12) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, size=(size, size, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def diffusion_batch():
    """Tensor columns (one >= 256 KiB so it is written as its own chunk), PNG media and input image,
    conditions, rewards map, targets, sampling JSON, batch metadata."""
    from unirl_core.types import (
        DiffusionSamplingParams,
        DiffusionSegment,
        Part,
        PromptRecord,
        Sample,
        SampleBatch,
    )

    rng = np.random.default_rng(SEED)
    g = torch.Generator().manual_seed(SEED)
    steps = 4
    sp = DiffusionSamplingParams(sigmas=torch.linspace(1, 0, steps + 1).tolist(), height=16, width=16)
    b = SampleBatch.from_prompts([PromptRecord(prompt_id=f"p{i}", prompt=f"a photo of {i} cats", targets={
        "ocr": f"text {i}", "label": "cat"}) for i in range(2)], samples_per_prompt=2, kind="diffusion",
        sampling=sp, policy_version=7, metadata={"run": "fuzz", "step": "3"})
    samples = []
    for i, s in enumerate(b):
        p = s.generated
        shape = (steps + 1, 16, 32, 32) if i == 0 else (steps + 1, 2, 4, 4)  # row 0: 320 KiB, a one-row chunk
        p.segment = DiffusionSegment(latents=torch.randn(shape, generator=g), log_probs=torch.randn(steps, generator=g),
                                     sigmas=torch.tensor(sp.sigmas), sde_mask=torch.tensor([True, False, True, True]))
        p.conditions = {"prompt_embeds": torch.randn(5, 8, generator=g).bfloat16(), "pooled": torch.randn(8, generator=g)}
        p.media = _png(rng)
        p.rewards = {"ocr": 0.25 * i, "aesthetic": -1.5 + i}
        p.reward = 0.5 * i
        p.advantage = 0.1 * i - 0.15
        p.valid = i != 3
        parts = [p]
        if i == 1:  # an edit-style sample: an input part with an image, then the generated part
            parts = [Part(kind="input", sample_id=s.sample_id, group_id=s.group_id, prompt="source",
                          image=_png(rng, 8)), p.copy(parent=0)]
        samples.append(Sample(sample_id=s.sample_id, group_id=s.group_id, parts=parts))
    return SampleBatch(samples=samples, metadata=dict(b.metadata))


def ar_batch():
    from unirl_core.types import (
        ARSamplingParams,
        PromptRecord,
        SampleBatch,
        TokenSegment,
    )

    g = torch.Generator().manual_seed(SEED + 1)
    b = SampleBatch.from_prompts([PromptRecord(prompt_id=f"q{i}", prompt=f"What is {i}*7? ünïcödé", targets={
        "answer": str(7 * i)}) for i in range(3)], samples_per_prompt=2, kind="ar",
        sampling=ARSamplingParams(temperature=0.9, stop=("</s>",)), policy_version=12, metadata={"step": "9"})
    for i, s in enumerate(b):
        p = s.generated
        r = 5 + 3 * i
        p.segment = TokenSegment(prompt_ids=torch.randint(0, 150000, (7,), generator=g),
                                 response_ids=torch.randint(0, 150000, (r,), generator=g),
                                 log_probs=-torch.rand(r, generator=g), response_mask=torch.rand(r, generator=g) > 0.2,
                                 finish_reason="stop" if i % 2 else "length")
        p.text = f"the answer is {7 * i} — done"
        p.rewards = {"math": float(i % 2)}
        p.reward = float(i % 2)
    return b


BATCHES = {"diffusion": diffusion_batch, "ar": ar_batch}


# ---------------------------------------------------------------- worker (runs in a spawned process)

def _worker(conn, originals: dict[str, str], workdir: str) -> None:
    from tests.unit.io.test_roundtrip import assert_same
    from unirl_core.errors import SchemaError
    from unirl_core.io import read_batch

    expected = {name: BATCHES[name]() for name in originals}
    data = {name: Path(p).read_bytes() for name, p in originals.items()}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        idx, name, op, arg, verify = msg
        path = Path(workdir) / f"case{idx}-{name}.arrow"
        path.write_bytes(_damage(data[name], op, arg, originals[name]))
        try:
            got = read_batch(path, verify=verify)
        except SchemaError as e:
            result = ("schema_error", str(path) in str(e), str(e)[:300])
        except BaseException as e:  # noqa: BLE001 - the very thing under test
            result = ("untyped", type(e).__name__, str(e)[:300])
        else:
            try:
                assert_same(expected[name], got)
                result = ("equal", None, None)
            except AssertionError as e:
                result = ("different", None, str(e)[:300])
            del got
        path.unlink()
        conn.send((idx, result))


def _damage(data: bytes, op: str, arg, original_path: str) -> bytes:
    if op == "flip":
        pos, xor = arg
        out = bytearray(data)
        out[pos] ^= xor
        return bytes(out)
    if op == "truncate":
        return data[:arg]
    if op == "foreign":
        return _foreign(arg)
    raise ValueError(op)


def _foreign(kind: str) -> bytes:
    if kind == "empty":
        return b""
    if kind == "random":
        return random.Random(SEED).randbytes(50_000)
    if kind == "arrow_magic_random":  # right magic at both ends, garbage between
        return b"ARROW1\x00\x00" + random.Random(SEED + 2).randbytes(5_000) + b"ARROW1"
    table = pa.table({"sample_id": ["a", "b"], "reward": [1.0, 2.0], "blob": [b"x" * 100, None]})
    sink = pa.BufferOutputStream()
    if kind == "parquet":
        pq.write_table(table, sink)
    elif kind == "arrow_other_schema":
        with pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
    elif kind == "arrow_stream":  # our own schema, but the IPC stream format (no footer)
        from unirl_core.io import batch_to_table

        t = batch_to_table(ar_batch())
        with pa.ipc.new_stream(sink, t.schema) as w:
            w.write_table(t)
    else:
        raise ValueError(kind)
    return sink.getvalue().to_pybytes()


FOREIGN = ("empty", "random", "arrow_magic_random", "parquet", "arrow_other_schema", "arrow_stream")


# ---------------------------------------------------------------- case generation (parent)

def column_regions(data: bytes) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of every column's buffers inside the file, by column name."""
    buf = pa.py_buffer(data)
    table = pa.ipc.open_file(buf).read_all()
    out: dict[str, list[tuple[int, int]]] = {}
    for name in table.column_names:
        ranges = []
        for chunk in table.column(name).chunks:
            for b in chunk.buffers():
                if b is not None and b.size:
                    ranges.append((b.address - buf.address, b.size))
        out[name] = ranges
    return out


def make_cases(name: str, data: bytes, rng: random.Random) -> list[tuple]:
    regions = column_regions(data)
    covered = np.zeros(len(data), dtype=bool)
    cases = []
    for col, ranges in regions.items():
        positions = [start + k for start, size in ranges for k in range(size)]
        for start, size in ranges:
            covered[start:start + size] = True
        for pos in rng.sample(positions, min(FLIPS_PER_COLUMN, len(positions))):
            cases.append((name, "flip", (pos, rng.choice([1 << rng.randrange(8), rng.randrange(1, 256)])), col))
    other = np.flatnonzero(~covered).tolist()  # schema, message metadata, padding, footer, magic
    for pos in rng.sample(other, min(FLIPS_OTHER, len(other))):
        cases.append((name, "flip", (pos, rng.choice([1 << rng.randrange(8), rng.randrange(1, 256)])), "<other>"))
    cuts = {1, 6, 8, 12, len(data) - 1, len(data) - 6, len(data) - 10, len(data) // 2}
    cuts |= {rng.randrange(1, len(data)) for _ in range(TRUNCATIONS)}
    cases += [(name, "truncate", c, "<truncate>") for c in sorted(cuts)]
    return cases


def _start(ctx, originals, workdir):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, originals, workdir), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def run_cases(cases: list[tuple], originals: dict[str, str], workdir: str) -> list[tuple]:
    """(case, result) for every case; a worker that dies or hangs is recorded and replaced."""
    ctx = mp.get_context("spawn")
    proc, conn = _start(ctx, originals, workdir)
    results = []
    try:
        for idx, (name, op, arg, label, verify) in enumerate(cases):
            conn.send((idx, name, op, arg, verify))
            deadline = CASE_TIMEOUT_S * (10 if idx == 0 else 1)  # the first case also pays the worker's imports
            if conn.poll(deadline):
                try:
                    _, result = conn.recv()
                except EOFError:
                    result = None
            else:
                result = ("hang", None, f"no answer in {deadline:.0f} s")
            if result is None:
                proc.join(5)
                result = ("crash", proc.exitcode, "worker died")
            results.append(((name, op, arg, label, verify), result))
            if result[0] in ("crash", "hang"):
                proc.kill()
                proc.join()
                proc, conn = _start(ctx, originals, workdir)
        conn.send(None)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    return results


@pytest.mark.slow
def test_damaged_files_never_crash_and_never_read_wrong(tmp_path):
    from unirl_core.io import write_batch

    rng = random.Random(SEED)
    originals = {}
    cases = []
    for name, build in BATCHES.items():
        path = write_batch(build(), tmp_path / f"{name}.arrow")
        originals[name] = str(path)
        cases += [(*c, True) for c in make_cases(name, path.read_bytes(), rng)]
    flips = [c for c in cases if c[1] == "flip"]
    cases += [(n, op, arg, label, False) for n, op, arg, label, _ in flips[::VERIFY_OFF_EVERY]]
    cases += [("ar", "foreign", kind, "<foreign>", v) for kind in FOREIGN for v in (True, False)]
    work = tmp_path / "work"
    work.mkdir()
    t0 = time.perf_counter()
    results = run_cases(cases, originals, str(work))
    elapsed = time.perf_counter() - t0

    bad = []
    tally: dict[str, int] = {}
    for (name, op, arg, label, verify), (status, extra, text) in results:
        tally[f"{status}/verify={verify}"] = tally.get(f"{status}/verify={verify}", 0) + 1
        case = f"{name} {op} {arg} [{label}] verify={verify}"
        if status in ("crash", "hang", "untyped"):
            bad.append(f"{case}: {status} {extra} {text}")
        elif status == "schema_error" and not extra:
            bad.append(f"{case}: SchemaError does not name the file: {text}")
        elif status == "different" and verify:
            bad.append(f"{case}: read back DIFFERENT data: {text}")
        elif op in ("foreign",) and status != "schema_error":
            bad.append(f"{case}: a foreign file was accepted")
        elif op == "truncate" and status != "schema_error":
            bad.append(f"{case}: a truncated file was accepted")
    print(f"\n{len(results)} cases in {elapsed:.1f} s: {dict(sorted(tally.items()))}")
    assert not bad, f"{len(bad)} of {len(results)} cases failed:\n" + "\n".join(bad[:40])
    # every column that has bytes in the file was hit by a flip, and most flips were caught
    hit = {(c[0], c[3]) for c in cases if c[1] == "flip"}
    with_bytes = {(n, col) for n, p in originals.items()
                  for col, ranges in column_regions(Path(p).read_bytes()).items() if ranges}
    assert with_bytes <= hit and len(with_bytes) > 50
    assert tally.get("schema_error/verify=True", 0) > len(flips) // 2


def test_every_column_flip_inside_tensor_bytes_is_caught(tmp_path):
    """A flip in a latent's bytes (zero-copy region) fails the checksum and names the column."""
    from unirl_core.errors import SchemaError
    from unirl_core.io import read_batch, write_batch

    path = write_batch(diffusion_batch(), tmp_path / "b.arrow")
    data = bytearray(path.read_bytes())
    (start, size), = [r for r in column_regions(bytes(data))["diffusion.latents"] if r[1] > 300_000]
    data[start + size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SchemaError, match=r"b.arrow: column 'diffusion.latents' fails its checksum"):
        read_batch(path)
    got = read_batch(path, verify=False)  # trusted-file mode: lazy, unverified
    assert got.generated[0].segment.latents.shape == (5, 16, 32, 32)
