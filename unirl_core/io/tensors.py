"""Tensors as Arrow columns: struct<dtype, shape, data> with each value's bytes padded to 8.

Padding keeps every tensor's first byte 8-aligned inside the IPC body (Arrow aligns each buffer to
8 bytes), so reads can wrap the memory-mapped bytes with ``torch.frombuffer`` instead of copying.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from unirl_core.errors import SchemaError

ALIGN = 8

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}

TENSOR_TYPE = pa.struct([
    pa.field("dtype", pa.string(), nullable=False),
    pa.field("shape", pa.list_(pa.int64()), nullable=False),
    pa.field("data", pa.large_binary(), nullable=False),
])


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _raw_bytes(t: Tensor) -> Tensor:
    """A contiguous CPU uint8 view of ``t`` (no copy when ``t`` is already contiguous on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _check_dtype(t: Tensor, field: str, row: int) -> None:
    if t.dtype not in DTYPE_NAMES:
        raise SchemaError(f"column '{field}' row {row}: dtype {t.dtype} is not storable; "
                          f"supported: {sorted(DTYPE_NAMES.values())}")


def tensor_column(values: Sequence[Tensor | None], field: str) -> pa.StructArray:
    """Pack tensors (or None) into one struct array with a single contiguous data buffer (one copy)."""
    n = len(values)
    pieces: list[Tensor] = []
    sizes: list[int] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    zeros = torch.zeros(ALIGN, dtype=torch.uint8)
    for i, t in enumerate(values):
        if t is None:
            sizes.append(0)
            dtypes.append("")
            shapes.append([])
            continue
        _check_dtype(t, field, i)
        raw = _raw_bytes(t)
        pad = _padded(raw.numel()) - raw.numel()
        pieces.append(raw)
        if pad:
            pieces.append(zeros[:pad])
        sizes.append(raw.numel() + pad)
        dtypes.append(DTYPE_NAMES[t.dtype])
        shapes.append(list(t.shape))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    data = torch.cat(pieces).numpy() if pieces else np.empty(0, dtype=np.uint8)  # one C-level copy
    mask = None if all(t is not None for t in values) else pa.array([t is not None for t in values]).buffers()[1]
    return _struct(n, mask, dtypes, shapes, pa.py_buffer(offsets), pa.py_buffer(data))


def single_tensor_column(t: Tensor, field: str) -> pa.StructArray:
    """One tensor as a 1-row struct array whose data buffer IS the tensor's memory (no copy).

    The IPC writer pads every buffer to 8 bytes, so the tensor still lands 8-aligned in the file.
    The array keeps a reference to the tensor until it is written.
    """
    _check_dtype(t, field, 0)
    raw = _raw_bytes(t)
    nbytes = raw.numel()
    buf = pa.py_buffer(raw.numpy()) if nbytes else pa.py_buffer(b"")
    offsets = pa.py_buffer(np.array([0, nbytes], dtype=np.int64))
    return _struct(1, None, [DTYPE_NAMES[t.dtype]], [list(t.shape)], offsets, buf)


BIG_TENSOR_BYTES = 1 << 18


def tensor_chunks(values: Sequence[Tensor | None], field: str) -> pa.ChunkedArray:
    """A column whose big tensors (>= 256 KiB) are written straight from their own memory.

    Small tensors are packed (copied) into shared chunks; each big one becomes a 1-row chunk that
    references the tensor, so the writer streams it to the file without an intermediate copy.
    """
    chunks: list[pa.Array] = []
    pending: list[Tensor | None] = []
    for t in values:
        if t is not None and t.numel() * t.element_size() >= BIG_TENSOR_BYTES:
            if pending:
                chunks.append(tensor_column(pending, field))
                pending = []
            chunks.append(single_tensor_column(t, field))
        else:
            pending.append(t)
    if pending or not chunks:
        chunks.append(tensor_column(pending, field))
    return pa.chunked_array(chunks, type=TENSOR_TYPE)


def _struct(n, mask, dtypes, shapes, offsets: pa.Buffer, data: pa.Buffer) -> pa.StructArray:
    data_arr = pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, offsets, data])
    children = [pa.array(dtypes, pa.string()), pa.array(shapes, pa.list_(pa.int64())), data_arr]
    return pa.StructArray.from_buffers(TENSOR_TYPE, n, [mask], children=children)


class TensorReader:
    """Builds tensors from a struct column, viewing the mapped file where the bytes live inside it."""

    def __init__(self, source: str, mapped: memoryview | None) -> None:
        self.source = source
        self._mapped = mapped
        self._base = pa.py_buffer(mapped).address if mapped is not None else 0
        self._size = len(mapped) if mapped is not None else 0

    def column(self, arr: pa.Array, field: str) -> list[Tensor | None]:
        if isinstance(arr, pa.ChunkedArray):
            return [t for chunk in arr.chunks for t in self.column(chunk, field)]
        if not pa.types.is_struct(arr.type) or arr.type != TENSOR_TYPE:
            raise SchemaError(f"{self.source}: column '{field}' has type {arr.type}, expected {TENSOR_TYPE}; "
                              "was this file written by unirl_core.io.write_batch?")
        dtypes = arr.field("dtype").to_pylist()
        shapes = arr.field("shape").to_pylist()
        data = arr.field("data")
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        bufs = data.buffers()
        offsets = np.frombuffer(bufs[1], dtype=np.int64, count=len(data) + 1, offset=data.offset * 8)
        body = bufs[2]
        out: list[Tensor | None] = []
        for i in range(len(arr)):
            out.append(self._one(field, i, valid[i], dtypes[i], shapes[i], body, offsets[i], offsets[i + 1]))
        return out

    def _one(self, field, i, valid, dtype, shape, body, start, stop) -> Tensor | None:
        if not valid:
            return None
        if dtype not in DTYPES:
            raise SchemaError(f"{self.source}: column '{field}' row {i}: unknown dtype {dtype!r}; "
                              f"expected one of {sorted(DTYPES)}")
        tdtype = DTYPES[dtype]
        count = math.prod(shape)
        nbytes = count * ITEMSIZE[dtype]
        if any(s < 0 for s in shape) or stop - start < nbytes or body is None and nbytes:
            raise SchemaError(f"{self.source}: column '{field}' row {i}: {stop - start} data bytes cannot hold "
                              f"a {dtype} tensor of shape {tuple(shape)} ({nbytes} bytes); the file is corrupt")
        if count == 0:
            return torch.empty(shape, dtype=tdtype)
        addr = body.address + int(start)
        if self._mapped is not None and self._base <= addr and addr + nbytes <= self._base + self._size:
            t = torch.frombuffer(self._mapped, dtype=tdtype, count=count, offset=addr - self._base)
        else:  # compressed or in-memory: the bytes live in an Arrow-owned buffer; copy once
            raw = np.frombuffer(body, dtype=np.uint8, count=nbytes, offset=int(start)).copy()
            t = torch.from_numpy(raw).view(tdtype)
        return t.view(shape)
