"""Streamed safetensors files: written straight from tensor memory, read into one buffer without copies.

``safetensors.torch.save`` builds the whole file as a new ``bytes`` object (a full copy, slow for GBs)
and ``safetensors.torch.load`` copies every tensor out again. Here the file is the standard format
(8-byte little-endian header length, JSON header, raw little-endian data; readable by
``safetensors.torch.load_file``), produced chunk by chunk from views of the tensors themselves while the
same chunks feed sha256; reads land in one bytearray and tensors are views into it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import torch
from torch import Tensor

from unirl_core.errors import CheckpointError, field_error

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_DTYPES = {v: k for k, v in _CODES.items()}
_CHUNK = 8 << 20


def as_bytes(t: Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def file_order(tensors: dict[str, Tensor]) -> list[str]:
    """The names in the order ``encode`` writes them (widest dtype first keeps every offset aligned)."""
    return sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))


def encode(tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, list[Tensor]]:
    """Header bytes and the tensors in file order (``file_order``)."""
    order = file_order(tensors)
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    ordered, offset = [], 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _CODES:
            raise field_error(CheckpointError, f"weights[{name!r}].dtype", t.dtype, f"one of {sorted(_DTYPES)}",
                              "cast the tensor to a supported dtype before saving")
        t = t.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        ordered.append(t)
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw, ordered


def chunks(header: bytes, tensors: list[Tensor]) -> Iterator[memoryview]:
    """The file's bytes as a sequence of views (header, then each tensor in pieces of at most 8 MB)."""
    yield memoryview(header)
    for t in tensors:
        view = as_bytes(t)
        for i in range(0, len(view), _CHUNK):
            yield view[i:i + _CHUNK]


def encoded_size(header: bytes, tensors: list[Tensor]) -> int:
    return len(header) + sum(t.numel() * t.element_size() for t in tensors)


def decode(buf: bytearray, where: str) -> dict[str, Tensor]:
    """Tensors viewing ``buf`` (a whole safetensors file); copies only entries whose offset is misaligned."""
    try:
        (n,) = struct.unpack_from("<Q", buf, 0)
        header = json.loads(bytes(buf[8:8 + n]))
        base = 8 + n
        out = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(s) for s in entry["shape"]]
            lo, hi = (int(x) for x in entry["data_offsets"])
            itemsize = torch.empty((), dtype=dtype).element_size()
            count = 1
            for s in shape:
                count *= s
            if hi - lo != count * itemsize or base + hi > len(buf) or lo < 0:
                raise ValueError(f"{name}: offsets {lo}..{hi} do not fit shape {shape} of {entry['dtype']}")
            if count == 0:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            start = base + lo
            if start % itemsize:
                raw = torch.frombuffer(bytearray(buf[start:base + hi]), dtype=torch.uint8)
            else:
                raw = torch.frombuffer(buf, dtype=torch.uint8, offset=start, count=hi - lo)
            out[name] = raw.view(dtype).reshape(shape)
        return out
    except (ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError) as e:
        raise field_error(CheckpointError, where, f"{type(e).__name__}: {e}", "a safetensors file",
                          "the file passed its checksum but is not safetensors; was it written by another tool?") from e
