"""Per-column checksums of a SampleBatch table, stored in the schema metadata and verified on read.

A column's checksum covers its *logical* content, not the IPC byte layout: for every node of the
column's type it streams the validity bits, the value lengths (lists, strings, binaries), the
fixed-width values and the string/binary bytes (tensor bytes and their 8-byte padding included)
into one CRC-32 per stream, and hashes the streams together. The same table therefore gives the
same checksum however it is chunked or sliced: in memory before ``write_batch`` writes it, and
after ``read_batch`` maps it back. Any changed value, length, null or tensor byte changes it.

CRC-32 (zlib, the stdlib) detects every single-byte change and every burst of up to 32 bits with
certainty, and random damage with probability 1 - 2**-32 per column; it is a damage check, not a
defense against someone forging a file. It was the fastest stdlib choice measured
(benchmarks/bench_arrow_io.py: ~4 GB/s vs sha256 ~1.8, blake2b ~0.9 on one core).
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pyarrow as pa

from unirl_core.errors import SchemaError

META_CHECKSUMS = b"unirl.checksums"
ALGO = "crc32"
VERIFY_ENV = "UNIRL_IO_VERIFY"
"""Set to ``0`` (or ``false``/``no``/``off``) to make ``read_batch`` skip checksums by default."""


def verify_default() -> bool:
    """``read_batch``'s ``verify`` when the caller passes None: on unless ``UNIRL_IO_VERIFY`` is 0/false/no/off."""
    raw = os.environ.get(VERIFY_ENV, "1").strip().lower()
    if raw in ("1", "true", "yes", "on", ""):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SchemaError(f"{VERIFY_ENV}={raw!r}: expected 1/true/yes/on or 0/false/no/off; "
                      f"unset it to verify checksums on read (the default)")


class _Streams:
    """One running CRC-32 per component path of a column."""

    def __init__(self) -> None:
        self.crc: dict[str, int] = {}

    def feed(self, path: str, data) -> None:
        if len(data):  # an empty feed leaves no trace: zero chunks and one empty chunk hash alike
            self.crc[path] = zlib.crc32(data, self.crc.get(path, 0))

    def digest(self) -> str:
        text = ";".join(f"{p}={c:08x}" for p, c in sorted(self.crc.items()))
        return f"{zlib.crc32(text.encode()):08x}"


_FIXED = {pa.int8(): 1, pa.int16(): 2, pa.int32(): 4, pa.int64(): 8, pa.uint8(): 1, pa.float16(): 2,
          pa.float32(): 4, pa.float64(): 8}


def _bits(buf: pa.Buffer | None, offset: int, n: int) -> bytes:
    """``n`` bits from ``offset`` as one byte each (1 when ``buf`` is absent: no nulls)."""
    if buf is None:
        return b"\x01" * n
    nbytes = (offset + n + 7) // 8
    raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
    return np.unpackbits(raw, bitorder="little")[offset:offset + n].tobytes()


def _offsets(buf: pa.Buffer, width: int, offset: int, n: int) -> np.ndarray:
    dtype = np.int32 if width == 4 else np.int64
    return np.frombuffer(buf, dtype=dtype, count=offset + n + 1)[offset:]


def _add(streams: _Streams, arr: pa.Array, path: str) -> None:
    t, n, off = arr.type, len(arr), arr.offset
    bufs = arr.buffers()
    streams.feed(path + "#valid", _bits(bufs[0], off, n))
    if n == 0:
        return
    if t in _FIXED:
        w = _FIXED[t]
        streams.feed(path + "#values", memoryview(bufs[1])[off * w:(off + n) * w])
    elif pa.types.is_boolean(t):
        streams.feed(path + "#values", _bits(bufs[1], off, n))
    elif pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        width = 8 if pa.types.is_large_string(t) or pa.types.is_large_binary(t) else 4
        o = _offsets(bufs[1], width, off, n)
        streams.feed(path + "#lengths", np.diff(o).astype(np.int64).tobytes())
        if o[-1] > o[0]:
            streams.feed(path + "#bytes", memoryview(bufs[2])[int(o[0]):int(o[-1])])
    elif pa.types.is_list(t) or pa.types.is_map(t):
        o = _offsets(bufs[1], 4, off, n)
        streams.feed(path + "#lengths", np.diff(o).astype(np.int64).tobytes())
        _add(streams, arr.values.slice(int(o[0]), int(o[-1] - o[0])), path + "/item")
    elif pa.types.is_struct(t):
        for i in range(t.num_fields):
            _add(streams, arr.field(i), f"{path}/{t.field(i).name}")
    else:  # pragma: no cover - every type of FIELDS is handled above
        raise SchemaError(f"column type {t} has no checksum rule; add one to unirl_core.io.integrity")


def column_checksum(col: pa.ChunkedArray | pa.Array) -> str:
    """The hex CRC-32 of a column's logical content (independent of chunking and slicing)."""
    streams = _Streams()
    for chunk in (col.chunks if isinstance(col, pa.ChunkedArray) else [col]):
        _add(streams, chunk, "")
    return streams.digest()


def metadata_checksum(meta: dict[bytes, bytes], keys: tuple[bytes, ...]) -> str:
    text = b"\x00".join(k + b"=" + meta.get(k, b"") for k in keys)
    return f"{zlib.crc32(text):08x}"


def table_checksums(table: pa.Table, meta_keys: tuple[bytes, ...]) -> bytes:
    """The ``unirl.checksums`` metadata value for ``table`` (JSON: algorithm, per column, schema metadata)."""
    meta = table.schema.metadata or {}
    doc = {"algo": ALGO, "columns": {name: column_checksum(table.column(name)) for name in table.column_names},
           "metadata": metadata_checksum(meta, meta_keys)}
    return json.dumps(doc, sort_keys=True).encode()


def verify_checksums(table: pa.Table, raw: bytes, meta_keys: tuple[bytes, ...], source: str) -> None:
    """Raise ``SchemaError`` naming the first column whose content differs from its stored checksum."""
    key = META_CHECKSUMS.decode()
    try:
        doc = json.loads(raw.decode())
        algo, columns, meta_sum = doc["algo"], doc["columns"], doc["metadata"]
        if not isinstance(columns, dict):
            raise TypeError("'columns' is not an object")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise SchemaError(f"{source}: schema metadata '{key}' cannot be decoded ({e}); the file is damaged - "
                          "re-write it, or read it with verify=False to skip checksums") from e
    if algo != ALGO:
        raise SchemaError(f"{source}: schema metadata '{key}' names algorithm {algo!r}, expected {ALGO!r}; "
                          "the file is damaged or from a newer unirl_core - re-write it with this version")
    if metadata_checksum(table.schema.metadata or {}, meta_keys) != meta_sum:
        raise SchemaError(f"{source}: the schema metadata (schema version, batch metadata) fails its checksum "
                          f"(stored {meta_sum!r}); the file is damaged - re-write it from its producer")
    for name in table.column_names:
        if name not in columns:
            raise SchemaError(f"{source}: column '{name}' has no checksum in '{key}'; the file is damaged - "
                              "re-write it from its producer")
        got = column_checksum(table.column(name))
        if got != columns[name]:
            raise SchemaError(f"{source}: column '{name}' fails its checksum (stored {columns[name]!r}, read "
                              f"{got!r}); the file is damaged - re-write it from its producer")
