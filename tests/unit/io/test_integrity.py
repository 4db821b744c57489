from __future__ import annotations

import json
import logging

import pyarrow as pa
import pytest
import torch

from tests.unit.io.test_bad_input import _rewrite, diffusion_batch
from tests.unit.io.test_roundtrip import assert_same
from unirl_core.errors import SchemaError
from unirl_core.io import batch_to_table, integrity, read_batch, write_batch
from unirl_core.io.integrity import META_CHECKSUMS, column_checksum, verify_default
from unirl_core.io.schema import META_BATCH, META_VERSION


def _big_batch():
    b = diffusion_batch()
    b[0].generated.segment.latents = torch.randn(5, 16, 32, 32)  # >= 256 KiB: its own chunk
    return b


@pytest.fixture(params=["xxh3_64", "crc32"])
def algo(request, monkeypatch):
    """Run with each checksum algorithm the writer may pick (xxhash is a core dependency: a missing one fails)."""
    assert integrity.xxhash is not None, "xxhash is a core dependency (pyproject.toml); reinstall the project"
    monkeypatch.setattr(integrity, "ALGO", request.param)
    return request.param


def test_checksums_are_independent_of_chunking_and_slicing(algo):
    t = batch_to_table(_big_batch())
    assert t.column("diffusion.latents").num_chunks > 1
    for name in t.column_names:
        col = t.column(name)
        whole = col.combine_chunks()
        assert column_checksum(whole) == column_checksum(col), name
        pieces = pa.chunked_array([whole.slice(0, 1), whole.slice(1, 2), whole.slice(3)], type=col.type)
        assert column_checksum(pieces) == column_checksum(col), name


def test_xxh3_file_without_xxhash_is_refused_with_the_fix(tmp_path, monkeypatch):
    assert integrity.xxhash is not None, "xxhash is a core dependency (pyproject.toml); reinstall the project"
    monkeypatch.setattr(integrity, "ALGO", "xxh3_64")
    path = write_batch(_big_batch(), tmp_path / "b.arrow")
    monkeypatch.setattr(integrity, "xxhash", None)
    with pytest.raises(SchemaError, match=r"b.arrow: .*pip install xxhash.*verify=False"):
        read_batch(path)
    read_batch(path, verify=False)


def test_write_stores_a_checksum_per_column(tmp_path, algo):
    b = _big_batch()
    path = write_batch(b, tmp_path / "b.arrow")
    assert_same(b, read_batch(path))
    meta = pa.ipc.open_file(str(path)).schema.metadata
    assert meta[META_VERSION] == b"2"
    doc = json.loads(meta[META_CHECKSUMS])
    assert doc["algo"] == algo and set(doc["columns"]) == set(pa.ipc.open_file(str(path)).schema.names)


def test_changed_value_fails_the_named_column(tmp_path, algo):
    path = write_batch(_big_batch(), tmp_path / "b.arrow")
    t = pa.ipc.open_file(str(path)).read_all()
    idx = t.schema.get_field_index("reward")
    bad = t.set_column(idx, t.schema.field("reward"), pa.array([9.0] * t.num_rows))
    path2 = _rewrite(tmp_path, bad.replace_schema_metadata(t.schema.metadata), "r.arrow")
    with pytest.raises(SchemaError, match=r"r.arrow: column 'reward' fails its checksum"):
        read_batch(path2)
    assert read_batch(path2, verify=False)[0].generated.reward == 9.0


def test_damaged_batch_metadata_and_checksum_entry(tmp_path):
    t = pa.ipc.open_file(str(write_batch(_big_batch(), tmp_path / "b.arrow"))).read_all()
    meta = dict(t.schema.metadata)
    path = _rewrite(tmp_path, t.replace_schema_metadata({**meta, META_BATCH: b'{"step": "4"}'}), "m.arrow")
    with pytest.raises(SchemaError, match=r"m.arrow: the schema metadata .* fails its checksum"):
        read_batch(path)
    path = _rewrite(tmp_path, t.replace_schema_metadata({**meta, META_CHECKSUMS: b'{"algo": "crc3'}), "c.arrow")
    with pytest.raises(SchemaError, match=r"c.arrow: schema metadata 'unirl.checksums' cannot be decoded"):
        read_batch(path)
    other = json.loads(meta[META_CHECKSUMS]) | {"algo": "md5"}
    path = _rewrite(tmp_path, t.replace_schema_metadata({**meta, META_CHECKSUMS: json.dumps(other).encode()}),
                    "a.arrow")
    with pytest.raises(SchemaError, match=r"a.arrow: .* names algorithm 'md5'"):
        read_batch(path)
    del meta[META_CHECKSUMS]
    path = _rewrite(tmp_path, t.replace_schema_metadata({**meta, b"unirl.checksumz": b"{}"}), "k.arrow")
    with pytest.raises(SchemaError, match=r"k.arrow: unknown schema metadata key b'unirl.checksumz'"):
        read_batch(path)


def test_version_1_files_read_unverified_with_a_warning(tmp_path, caplog):
    b = _big_batch()
    t = batch_to_table(b)  # no checksums: write_batch adds them
    path = _rewrite(tmp_path, t.replace_schema_metadata({**t.schema.metadata, META_VERSION: b"1"}), "v1.arrow")
    with caplog.at_level(logging.WARNING, logger="unirl_core.io.ipc"):
        got = read_batch(path)
    assert_same(b, got)
    assert "v1.arrow: schema_version 1 file without checksums" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unirl_core.io.ipc"):
        read_batch(path, verify=False)
    assert caplog.text == ""


def test_verify_switch_from_the_environment(tmp_path, monkeypatch, algo):
    path = write_batch(_big_batch(), tmp_path / "b.arrow")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the big latent
    path.write_bytes(bytes(data))
    with pytest.raises(SchemaError, match="fails its checksum"):
        read_batch(path)
    monkeypatch.setenv("UNIRL_IO_VERIFY", "0")
    assert not verify_default()
    read_batch(path)  # trusted-file mode: unverified
    with pytest.raises(SchemaError, match="fails its checksum"):
        read_batch(path, verify=True)  # the argument wins over the environment
    monkeypatch.setenv("UNIRL_IO_VERIFY", "maybe")
    with pytest.raises(SchemaError, match="UNIRL_IO_VERIFY='maybe'"):
        read_batch(path)


def test_verified_reads_stay_zero_copy(tmp_path):
    from tests.unit.io.test_bad_input import _mapping_of

    path = write_batch(_big_batch(), tmp_path / "b.arrow")
    for verify in (True, False):
        got = read_batch(path, verify=verify)
        assert all(_mapping_of(p.segment.latents.data_ptr()) == str(path) for p in got.generated)
