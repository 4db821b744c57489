"""Wire format between the reward client and server: Arrow IPC streams.

Request: one row per item (``prompt`` utf8, ``text`` utf8?, ``media`` binary? holding the PNG
bytes as they are, ``targets`` JSON utf8, ``num_tokens`` int64?) plus schema metadata naming the
components (with kwargs) and whether failures are isolated per item. Response: per component k,
``score_k`` float64 (NaN allowed) and ``error_k`` utf8 (null when the item scored).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa

from unirl_core.errors import SchemaError
from unirl_core.reward.config import RewardComponent
from unirl_core.reward.scorers.base import ComponentScores, ScoreItem

WIRE_VERSION = "1"
CONTENT_TYPE = "application/vnd.apache.arrow.stream"
_REQUEST_SCHEMA = pa.schema([("prompt", pa.string()), ("text", pa.string()), ("media", pa.large_binary()),
                             ("targets", pa.string()), ("num_tokens", pa.int64())])


def _to_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _read(body: bytes, what: str) -> pa.Table:
    try:
        return pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise SchemaError(f"{what}: not an Arrow IPC stream ({len(body)} bytes): {e}") from e


def encode_request(items: Sequence[ScoreItem], components: Sequence[RewardComponent], *, isolate: bool) -> bytes:
    meta = {
        b"unirl.reward.wire_version": WIRE_VERSION.encode(),
        b"unirl.reward.components": json.dumps([{"name": c.name, "kwargs": c.kwargs} for c in components]).encode(),
        b"unirl.reward.isolate": b"1" if isolate else b"0",
    }
    table = pa.table({
        "prompt": [it.prompt for it in items], "text": [it.text for it in items],
        "media": [it.media for it in items], "targets": [json.dumps(it.targets) for it in items],
        "num_tokens": [it.num_tokens for it in items],
    }, schema=_REQUEST_SCHEMA.with_metadata(meta))
    return _to_bytes(table)


def decode_request(body: bytes) -> tuple[list[ScoreItem], list[RewardComponent], bool]:
    """Items, components and the isolate flag; raises SchemaError naming the bad field."""
    table = _read(body, "reward request")
    meta = table.schema.metadata or {}
    version = meta.get(b"unirl.reward.wire_version", b"").decode()
    if version != WIRE_VERSION:
        raise SchemaError(f"reward request: wire_version={version!r}, expected {WIRE_VERSION!r}; "
                          "client and server come from different versions of unirl_core")
    if not table.schema.remove_metadata().equals(_REQUEST_SCHEMA):
        raise SchemaError(f"reward request: schema {table.schema.remove_metadata()} != expected {_REQUEST_SCHEMA}")
    try:
        comps = [RewardComponent(name=c["name"], kwargs=c.get("kwargs", {}))
                 for c in json.loads(meta[b"unirl.reward.components"])]
        cols = table.to_pydict()
        items = [ScoreItem(prompt=p or "", text=t, media=m, targets=json.loads(tg) if tg else {}, num_tokens=n)
                 for p, t, m, tg, n in zip(cols["prompt"], cols["text"], cols["media"], cols["targets"],
                                           cols["num_tokens"])]
    except (KeyError, TypeError, ValueError) as e:
        raise SchemaError(f"reward request: bad components or targets metadata: {e}") from e
    return items, comps, meta.get(b"unirl.reward.isolate") == b"1"


def encode_response(results: Sequence[ComponentScores]) -> bytes:
    cols: dict[str, pa.Array] = {}
    for k, r in enumerate(results):
        cols[f"score_{k}"] = pa.array(r.values, type=pa.float64())
        cols[f"error_{k}"] = pa.array(r.errors, type=pa.string())
    table = pa.table(cols, metadata={b"unirl.reward.wire_version": WIRE_VERSION.encode()})
    return _to_bytes(table)


def decode_response(body: bytes, *, num_components: int, num_items: int) -> list[ComponentScores]:
    table = _read(body, "reward response")
    want = [f"{p}_{k}" for k in range(num_components) for p in ("score", "error")]
    if table.column_names != want or table.num_rows != num_items:
        raise SchemaError(f"reward response: columns {table.column_names} x {table.num_rows} rows, expected "
                          f"{want} x {num_items} rows; client and server disagree on the request")
    cols = table.to_pydict()
    return [ComponentScores(values=[float(v) for v in cols[f"score_{k}"]], errors=cols[f"error_{k}"])
            for k in range(num_components)]
