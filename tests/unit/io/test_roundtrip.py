from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import HealthCheck, given, settings

from unirl_core.io import batch_to_table, read_batch, table_to_batch, write_batch
from unirl_core.types import SampleBatch

from tests.unit.io.strategies import batches

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_same(x: SampleBatch, y: SampleBatch) -> None:
    assert x.metadata == y.metadata
    assert [s.sample_id for s in x] == [s.sample_id for s in y]
    for sx, sy in zip(x, y):
        assert sx.group_id == sy.group_id and len(sx.parts) == len(sy.parts)
        for px, py in zip(sx.parts, sy.parts):
            for f in dataclasses.fields(px):
                a, b = getattr(px, f.name), getattr(py, f.name)
                if f.name == "segment":
                    assert type(a) is type(b)
                    if a is not None:
                        for g in dataclasses.fields(a):
                            va, vb = getattr(a, g.name), getattr(b, g.name)
                            assert bits_equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, g.name
                elif f.name == "conditions":
                    assert a.keys() == b.keys()
                    assert all(bits_equal(a[k], b[k]) for k in a)
                elif isinstance(a, float) and math.isnan(a):
                    assert math.isnan(b)
                else:
                    assert a == b, f.name


@SETTINGS
@given(batch=batches())
def test_table_roundtrip_is_bit_exact(batch):
    assert_same(batch, table_to_batch(batch_to_table(batch)))


@SETTINGS
@given(batch=batches())
def test_file_roundtrip_is_bit_exact(batch, tmp_path_factory):
    path = tmp_path_factory.mktemp("rt") / "b.arrow"
    write_batch(batch, path)
    assert_same(batch, read_batch(path))
    assert_same(batch, read_batch(path, memory_map=False))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches())
def test_compressed_roundtrip_is_bit_exact(batch, tmp_path_factory):
    d = tmp_path_factory.mktemp("cz")
    for codec in ("zstd", "lz4"):
        write_batch(batch, d / f"{codec}.arrow", compression=codec)
        assert_same(batch, read_batch(d / f"{codec}.arrow"))


def test_empty_batch_roundtrip(tmp_path):
    write_batch(SampleBatch(metadata={"step": "0"}), tmp_path / "e.arrow")
    got = read_batch(tmp_path / "e.arrow")
    assert len(got) == 0 and got.metadata == {"step": "0"}


def test_big_tensors_are_written_from_their_own_memory_and_read_bit_exact(tmp_path):
    from tests.unit.io.test_bad_input import _mapping_of, diffusion_batch
    from unirl_core.io.tensors import BIG_TENSOR_BYTES

    b = diffusion_batch(2, 2, steps=3)
    g = torch.Generator().manual_seed(1)
    for i, s in enumerate(b):  # mix big fp32 / bf16 trajectories with small ones
        shape = (4, 16, 64, 64) if i % 2 == 0 else (4, 4, 8, 8)
        lat = torch.randn(shape, generator=g)
        s.generated.segment.latents = lat.bfloat16() if i == 2 else lat
    assert b[0].generated.segment.latents.nbytes >= BIG_TENSOR_BYTES
    path = write_batch(b, tmp_path / "big.arrow")
    got = read_batch(path)
    assert_same(b, got)
    assert all(_mapping_of(p.segment.latents.data_ptr()) == str(path) for p in got.generated)
    assert all(p.segment.latents.data_ptr() % 8 == 0 for p in got.generated)
