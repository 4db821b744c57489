"""Arrow IPC files of SampleBatches: atomic writes, memory-mapped zero-copy reads."""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path
from typing import Literal

import pyarrow as pa

from unirl_core.errors import SchemaError, field_error
from unirl_core.io.arrow import batch_to_table, table_to_batch
from unirl_core.io.tensors import TensorReader
from unirl_core.types import SampleBatch

Compression = Literal["zstd", "lz4"] | None
_COMPRESSIONS = (None, "zstd", "lz4")


def write_batch(batch: SampleBatch, path: str | os.PathLike, *, compression: Compression = None,
                fsync: bool = False) -> Path:
    """Write ``batch`` to ``path`` as one Arrow IPC file.

    The bytes go to a temporary name in the same folder and are renamed into place, so a crash leaves
    either the previous file or none, never a half file. ``fsync`` also survives power loss.
    Compressed files cannot be read without copying.
    """
    if compression not in _COMPRESSIONS:
        raise field_error(SchemaError, "compression", compression, "None, 'zstd' or 'lz4'",
                          "leave compression off for zero-copy reads")
    path = Path(path)
    table = batch_to_table(batch)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    options = pa.ipc.IpcWriteOptions(compression=compression)
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema, options=options) as writer:
            writer.write_table(table)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_batch(path: str | os.PathLike, *, memory_map: bool = True) -> SampleBatch:
    """Read a batch written by ``write_batch``.

    With ``memory_map`` the file is mapped copy-on-write: uncompressed tensors view the mapped bytes
    (no copy, writable; a write touches only this process's private page), and stay valid after the
    file is deleted or replaced.
    """
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise SchemaError(f"{source}: no such file; expected an Arrow IPC batch written by write_batch")
    if path.stat().st_size == 0:
        raise SchemaError(f"{source}: the file is empty (0 bytes); it is not an Arrow IPC batch")
    mapped = None
    with open(path, "rb") as f:
        if memory_map:
            mapped = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
            buf = pa.py_buffer(mapped)
        else:
            buf = pa.py_buffer(f.read())
    try:
        reader = pa.ipc.open_file(buf)
        table = reader.read_all()
        table.validate()
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise SchemaError(f"{source}: not a complete Arrow IPC file ({e}); it may be truncated, damaged, or "
                          "written by another program") from e
    return table_to_batch(table, source=source, reader=TensorReader(source, mapped))
