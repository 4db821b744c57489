"""The versioned Arrow schema of a SampleBatch: one row per Part, in sample order.

Bump ``SCHEMA_VERSION`` on any change readers must know about; readers refuse versions they do not list
in ``READABLE_VERSIONS``.

Version 2 (current) = version 1 + per-column checksums in the ``unirl.checksums`` schema metadata
(``unirl_core.io.integrity``). Version 1 files still read, unverified, with a logged warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pyarrow as pa

from unirl_core.errors import SchemaError, UniRLError
from unirl_core.io.integrity import META_CHECKSUMS
from unirl_core.io.tensors import TENSOR_TYPE
from unirl_core.types import ARSamplingParams, DiffusionSamplingParams, SamplingParams

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
READABLE_VERSIONS = ("1", "2")
META_VERSION = b"unirl.schema_version"
META_BATCH = b"unirl.batch_metadata"
CHECKSUMMED_META = (META_VERSION, META_BATCH)
"""Schema metadata entries covered by the ``metadata`` checksum."""
_KNOWN_META = (META_VERSION, META_BATCH, META_CHECKSUMS)

# Segment tensors: column name -> (segment kind, attribute)
SEGMENT_TENSORS: dict[str, tuple[str, str]] = {
    "diffusion.latents": ("diffusion", "latents"),
    "diffusion.log_probs": ("diffusion", "log_probs"),
    "diffusion.sigmas": ("diffusion", "sigmas"),
    "diffusion.sde_mask": ("diffusion", "sde_mask"),
    "tokens.prompt_ids": ("ar", "prompt_ids"),
    "tokens.response_ids": ("ar", "response_ids"),
    "tokens.log_probs": ("ar", "log_probs"),
    "tokens.response_mask": ("ar", "response_mask"),
}

CONDITION_TYPE = pa.list_(pa.struct([pa.field("name", pa.string(), nullable=False),
                                     pa.field("tensor", TENSOR_TYPE, nullable=False)]))

FIELDS: list[pa.Field] = [
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("part_index", pa.int32(), nullable=False),
    pa.field("kind", pa.string(), nullable=False),
    pa.field("parent", pa.int32()),
    pa.field("prompt", pa.large_string(), nullable=False),
    pa.field("image", pa.large_binary()),
    pa.field("targets", pa.map_(pa.string(), pa.string())),
    pa.field("sampling", pa.string()),
    pa.field("finish_reason", pa.string()),
    *[pa.field(name, TENSOR_TYPE) for name in SEGMENT_TENSORS],
    pa.field("conditions", CONDITION_TYPE),
    pa.field("media", pa.large_binary()),
    pa.field("text", pa.large_string()),
    pa.field("rewards", pa.map_(pa.string(), pa.float64())),
    pa.field("reward", pa.float64()),
    pa.field("valid", pa.bool_(), nullable=False),
    pa.field("advantage", pa.float64()),
    pa.field("policy_version", pa.int64(), nullable=False),
]


def batch_schema(batch_metadata: dict[str, str]) -> pa.Schema:
    meta = {META_VERSION: str(SCHEMA_VERSION).encode(), META_BATCH: json.dumps(batch_metadata).encode()}
    return pa.schema(FIELDS, metadata=meta)


def check_schema(schema: pa.Schema, source: str) -> dict[str, str]:
    """Validate version and columns; return the batch metadata."""
    meta = schema.metadata or {}
    if META_VERSION not in meta:
        raise SchemaError(f"{source}: no '{META_VERSION.decode()}' in the schema metadata; this Arrow file was "
                          "not written by unirl_core.io.write_batch")
    version = meta[META_VERSION].decode(errors="replace")
    if version not in READABLE_VERSIONS:
        raise SchemaError(f"{source}: schema_version={version}, this reader supports {', '.join(READABLE_VERSIONS)}; "
                          "re-write the batch with the matching unirl_core version")
    unknown = [k for k in meta if k.startswith(b"unirl.") and k not in _KNOWN_META]
    if unknown:
        raise SchemaError(f"{source}: unknown schema metadata key {unknown[0]!r} (known: "
                          f"{[k.decode() for k in _KNOWN_META]}); the file is damaged or from a newer unirl_core")
    for f in FIELDS:
        if f.name not in schema.names:
            raise SchemaError(f"{source}: column '{f.name}' is missing (schema_version {version})")
        got = schema.field(f.name).type
        if got != f.type:
            raise SchemaError(f"{source}: column '{f.name}' has type {got}, expected {f.type}")
    try:
        out = json.loads(meta.get(META_BATCH, b"{}").decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SchemaError(f"{source}: schema metadata '{META_BATCH.decode()}' is not valid JSON ({e})") from e
    if not isinstance(out, dict):
        raise SchemaError(f"{source}: schema metadata '{META_BATCH.decode()}' is not a JSON object")
    return out


def sampling_to_json(sp: SamplingParams | None) -> str | None:
    if sp is None:
        return None
    kind = "diffusion" if isinstance(sp, DiffusionSamplingParams) else "ar"
    return json.dumps({"kind": kind, **dataclasses.asdict(sp)})


def sampling_from_json(text: str | None, source: str, row: int) -> SamplingParams | None:
    if text is None:
        return None
    try:
        d = json.loads(text)
        kind = d.pop("kind")
        if kind == "diffusion":
            d["sigmas"] = tuple(d["sigmas"])
            if d.get("sde_window_range") is not None:
                d["sde_window_range"] = tuple(d["sde_window_range"])
            return DiffusionSamplingParams(**d)
        if kind == "ar":
            d["stop"] = tuple(d["stop"])
            return ARSamplingParams(**d)
    except UniRLError:
        raise  # a sampling field out of range: the caller names the row
    except Exception as e:  # damaged JSON of any shape
        raise SchemaError(f"{source}: column 'sampling' row {row} cannot be decoded ({type(e).__name__}: {e})") from e
    raise SchemaError(f"{source}: column 'sampling' row {row} has kind {kind!r}, expected 'diffusion' or 'ar'")
