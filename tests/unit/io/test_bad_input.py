from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from unirl_core.errors import SchemaError
from unirl_core.io import batch_to_table, read_batch, write_batch
from unirl_core.io.schema import META_VERSION
from unirl_core.types import DiffusionSamplingParams, DiffusionSegment, PromptRecord, SampleBatch


def diffusion_batch(n_prompts: int = 2, k: int = 2, steps: int = 4) -> SampleBatch:
    sp = DiffusionSamplingParams(sigmas=torch.linspace(1, 0, steps + 1).tolist())
    b = SampleBatch.from_prompts([PromptRecord(prompt_id=f"p{i}", prompt=f"prompt {i}") for i in range(n_prompts)],
                                 samples_per_prompt=k, kind="diffusion", sampling=sp)
    g = torch.Generator().manual_seed(0)
    for s in b:
        s.generated.segment = DiffusionSegment(latents=torch.randn(steps + 1, 4, 8, 8, generator=g),
                                               log_probs=torch.randn(steps, generator=g),
                                               sigmas=torch.tensor(sp.sigmas), sde_mask=torch.ones(steps, dtype=bool))
    return b


def test_truncated_file_names_the_file(tmp_path):
    path = write_batch(diffusion_batch(), tmp_path / "b.arrow")
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 7, 12):
        bad = tmp_path / f"cut{cut}.arrow"
        bad.write_bytes(data[:cut])
        with pytest.raises(SchemaError, match=str(bad)):
            read_batch(bad)


def test_non_arrow_and_empty_and_missing(tmp_path):
    (tmp_path / "x.arrow").write_text("hello, not arrow at all" * 10)
    with pytest.raises(SchemaError, match="not a complete Arrow IPC file"):
        read_batch(tmp_path / "x.arrow")
    (tmp_path / "e.arrow").write_bytes(b"")
    with pytest.raises(SchemaError, match="empty"):
        read_batch(tmp_path / "e.arrow")
    with pytest.raises(SchemaError, match="no such file"):
        read_batch(tmp_path / "missing.arrow")


def test_corrupt_footer_is_caught(tmp_path):
    path = write_batch(diffusion_batch(), tmp_path / "b.arrow")
    data = bytearray(path.read_bytes())
    data[-20:-10] = b"\xff" * 10
    path.write_bytes(bytes(data))
    with pytest.raises(SchemaError, match="b.arrow"):
        read_batch(path)


def _rewrite(tmp_path, table: pa.Table, name: str):
    path = tmp_path / name
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return path


def test_wrong_schema_version(tmp_path):
    t = batch_to_table(diffusion_batch())
    meta = dict(t.schema.metadata)
    meta[META_VERSION] = b"999"
    path = _rewrite(tmp_path, t.replace_schema_metadata(meta), "v.arrow")
    with pytest.raises(SchemaError, match=r"schema_version=999"):
        read_batch(path)


def test_foreign_arrow_file(tmp_path):
    path = _rewrite(tmp_path, pa.table({"a": [1, 2, 3]}), "foreign.arrow")
    with pytest.raises(SchemaError, match="not written by unirl_core"):
        read_batch(path)


def test_missing_and_mistyped_column(tmp_path):
    t = batch_to_table(diffusion_batch())
    path = _rewrite(tmp_path, t.drop_columns(["media"]).replace_schema_metadata(t.schema.metadata), "m.arrow")
    with pytest.raises(SchemaError, match="column 'media' is missing"):
        read_batch(path)
    idx = t.schema.get_field_index("reward")
    t2 = t.set_column(idx, pa.field("reward", pa.string()), pa.array(["x"] * t.num_rows))
    path = _rewrite(tmp_path, t2.replace_schema_metadata(t.schema.metadata), "t.arrow")
    with pytest.raises(SchemaError, match="column 'reward' has type string"):
        read_batch(path)


def _with_shape(table: pa.Table, column: str, shape: list[int]) -> pa.Table:
    """``table`` with every row of tensor ``column`` claiming ``shape`` (the bytes unchanged)."""
    col = table.column(column).combine_chunks()
    shapes = pa.array([shape] * len(col), pa.list_(pa.int64()))
    bad = pa.StructArray.from_arrays([col.field("dtype"), shapes, col.field("data")], fields=list(col.type))
    return table.set_column(table.schema.get_field_index(column), table.schema.field(column), bad)


def test_tensor_bytes_too_short_for_shape(tmp_path):
    t = batch_to_table(diffusion_batch())
    path = _rewrite(tmp_path, _with_shape(t, "diffusion.log_probs", [999]), "s.arrow")
    with pytest.raises(SchemaError, match=r"column 'diffusion.log_probs' row 0: .*corrupt"):
        read_batch(path)


def test_invariant_violation_in_file_names_row(tmp_path):
    t = batch_to_table(diffusion_batch())
    path = _rewrite(tmp_path, _with_shape(t, "diffusion.sigmas", [2]), "inv.arrow")
    with pytest.raises(SchemaError, match=r"inv.arrow: row 0 .*segment.sigmas"):
        read_batch(path)


def test_failed_write_keeps_previous_file(tmp_path):
    path = write_batch(diffusion_batch(1, 1), tmp_path / "b.arrow")
    before = path.read_bytes()
    bad = diffusion_batch()
    bad.generated[0].conditions = {"x": torch.zeros(2, dtype=torch.complex64)}
    with pytest.raises(SchemaError, match="not storable"):
        write_batch(bad, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.arrow"]


def _mapping_of(addr: int) -> str:
    """Path of the /proc/self/maps entry holding ``addr`` ('' for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            cols = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in cols[0].split("-"))
            if lo <= addr < hi:
                return cols[5].strip() if len(cols) == 6 else ""
    return ""


def test_reads_do_not_copy_tensor_bytes(tmp_path):
    path = write_batch(diffusion_batch(), tmp_path / "b.arrow")
    got = read_batch(path)
    tensors = [t for p in got.generated for t in (p.segment.latents, p.segment.log_probs, p.segment.sigmas)]
    # every tensor's bytes live in a mapping of the file itself, 8-byte aligned
    assert all(_mapping_of(t.data_ptr()) == str(path) for t in tensors)
    assert all(t.data_ptr() % 8 == 0 for t in tensors)
    copied = read_batch(path, memory_map=False)
    assert not any(_mapping_of(p.segment.latents.data_ptr()) == str(path) for p in copied.generated)
    compressed = read_batch(write_batch(diffusion_batch(), tmp_path / "z.arrow", compression="zstd"))
    assert torch.equal(compressed.generated[0].segment.latents, got.generated[0].segment.latents)


def test_written_tensors_stay_valid_after_file_replaced(tmp_path):
    b = diffusion_batch()
    path = write_batch(b, tmp_path / "b.arrow")
    got = read_batch(path)
    got.generated[0].segment.latents.mul_(0)  # copy-on-write: the file is untouched
    write_batch(diffusion_batch(1, 1), path)
    assert torch.equal(read_batch(path).generated[0].segment.latents, b.generated[0].segment.latents)
    assert got.generated[1].segment.latents.shape == b.generated[1].segment.latents.shape
