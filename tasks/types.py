"""Flyte type for SampleBatch: a Blob literal of format ``arrow-ipc`` keyed by content hash.

Tasks declare ``-> HashedSampleBatch`` (``SampleBatch`` annotated with a content ``HashMethod``): the
literal then carries the sha256 of the Arrow file, so cache keys hash the content rather than the
random upload path, and an unchanged step hits the cache on re-run. A plain ``SampleBatch``
annotation works too, without content-keyed caching.
"""

from __future__ import annotations

import hashlib
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Annotated

from flytekit import FlyteContext, HashMethod
from flytekit.extend import TypeEngine, TypeTransformer
from flytekit.core.type_engine import TypeTransformerFailedError
from flytekit.models.core.types import BlobType
from flytekit.models.literals import Blob, BlobMetadata, Literal, Scalar
from flytekit.models.types import LiteralType

from unirl_core.errors import SchemaError, field_error
from unirl_core.io import read_batch, write_batch
from unirl_core.report.preview import batch_preview_html
from unirl_core.types import SampleBatch

ARROW_IPC_FORMAT = "arrow-ipc"
_BLOB_TYPE = BlobType(format=ARROW_IPC_FORMAT, dimensionality=BlobType.BlobDimensionality.SINGLE)


# digest of the file written by to_literal, looked up by HashMethod right after (TypeEngine sets lv.hash
# from the annotation, overwriting any hash the transformer puts on the literal)
_DIGESTS: weakref.WeakKeyDictionary[SampleBatch, str] = weakref.WeakKeyDictionary()


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


class SampleBatchTransformer(TypeTransformer[SampleBatch]):
    def __init__(self) -> None:
        super().__init__(name="SampleBatch", t=SampleBatch)

    def get_literal_type(self, t: type[SampleBatch]) -> LiteralType:
        return LiteralType(blob=_BLOB_TYPE)

    def to_literal(self, ctx: FlyteContext, python_val: SampleBatch, python_type: type[SampleBatch],
                   expected: LiteralType) -> Literal:
        if not isinstance(python_val, SampleBatch):
            raise TypeTransformerFailedError(f"expected a SampleBatch, got {type(python_val).__name__}")
        local = Path(ctx.file_access.get_random_local_directory()) / "batch.arrow"
        write_batch(python_val, local)
        _DIGESTS[python_val] = digest = f"sha256:{file_sha256(local)}"
        # our own uuid: flytekit's random prefix comes from a module RNG that user code may reseed
        uri = ctx.file_access.put_raw_data(str(local), upload_prefix=uuid.uuid4().hex, file_name="batch.arrow")
        return Literal(scalar=Scalar(blob=Blob(metadata=BlobMetadata(type=_BLOB_TYPE), uri=uri)), hash=digest)

    def to_python_value(self, ctx: FlyteContext, lv: Literal, expected_python_type: type[SampleBatch]) -> SampleBatch:
        blob = lv.scalar.blob if lv.scalar else None
        if blob is None or blob.metadata.type.format != ARROW_IPC_FORMAT:
            raise TypeTransformerFailedError(f"expected a Blob literal of format {ARROW_IPC_FORMAT!r}, got {lv}")
        uri = blob.uri
        if ctx.file_access.is_remote(uri):
            local = ctx.file_access.get_random_local_path("batch.arrow")
            ctx.file_access.get_data(uri, local)
        else:  # local raw store: map the file in place, no copy
            local = uri.removeprefix("file://")
            if not Path(local).is_file():
                # flytekit's local task cache (~/.flyte/local-cache) outlives its sandbox under the temp dir
                raise field_error(SchemaError, "SampleBatch literal uri", uri, "an Arrow IPC file that exists",
                                  "a cached task output names a file of flytekit's local sandbox that was removed "
                                  "(a wiped temp dir, e.g. after a reboot): run `pyflyte local-cache clear`, or "
                                  "`pyflyte run --overwrite-cache ...`, and run again")
        return read_batch(local)

    def guess_python_type(self, literal_type: LiteralType) -> type[SampleBatch]:
        if literal_type.blob is not None and literal_type.blob.format == ARROW_IPC_FORMAT:
            return SampleBatch
        raise ValueError(f"cannot guess a SampleBatch from {literal_type}")

    def to_html(self, ctx: FlyteContext, python_val: SampleBatch, expected_python_type: type[SampleBatch]) -> str:
        return batch_preview_html(python_val)


def batch_content_hash(batch: SampleBatch) -> str:
    """sha256 of the batch's Arrow IPC bytes (reuses the digest of the file to_literal just wrote)."""
    digest = _DIGESTS.get(batch)
    if digest is None:
        with tempfile.TemporaryDirectory() as d:
            digest = f"sha256:{file_sha256(write_batch(batch, Path(d) / 'batch.arrow'))}"
    return digest


HashedSampleBatch = Annotated[SampleBatch, HashMethod(batch_content_hash)]

TypeEngine.register(SampleBatchTransformer())
