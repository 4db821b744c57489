"""SampleBatch <-> pyarrow.Table (one row per Part)."""

from __future__ import annotations

import pyarrow as pa

from unirl_core.errors import SchemaError, UniRLError
from unirl_core.io.schema import (
    CONDITION_TYPE,
    SEGMENT_TENSORS,
    batch_schema,
    check_schema,
    sampling_from_json,
    sampling_to_json,
)
from unirl_core.io.tensors import TensorReader, tensor_chunks, tensor_column
from unirl_core.types import DiffusionSegment, Part, Sample, SampleBatch, TokenSegment

_SEGMENT_CLS = {"diffusion": DiffusionSegment, "ar": TokenSegment}


def _conditions_column(parts: list[Part]) -> pa.Array:
    names, tensors, offsets = [], [], [0]
    for p in parts:
        for k, v in p.conditions.items():
            names.append(k)
            tensors.append(v)
        offsets.append(len(names))
    structs = pa.StructArray.from_arrays([pa.array(names, pa.string()), tensor_column(tensors, "conditions")],
                                         fields=list(CONDITION_TYPE.value_type))
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), structs, type=CONDITION_TYPE)


def batch_to_table(batch: SampleBatch) -> pa.Table:
    """Encode a batch; big segment tensors are referenced, small ones copied once into shared buffers."""
    parts = [(s, i, p) for s in batch.samples for i, p in enumerate(s.parts)]
    ps = [p for _, _, p in parts]
    cols: dict[str, pa.Array | pa.ChunkedArray] = {
        "sample_id": pa.array([s.sample_id for s, _, _ in parts], pa.string()),
        "group_id": pa.array([s.group_id for s, _, _ in parts], pa.string()),
        "part_index": pa.array([i for _, i, _ in parts], pa.int32()),
        "kind": pa.array([p.kind for p in ps], pa.string()),
        "parent": pa.array([p.parent for p in ps], pa.int32()),
        "prompt": pa.array([p.prompt for p in ps], pa.large_string()),
        "image": pa.array([p.image for p in ps], pa.large_binary()),
        "targets": pa.array([list(p.targets.items()) for p in ps], pa.map_(pa.string(), pa.string())),
        "sampling": pa.array(_sampling_json(ps), pa.string()),
        "finish_reason": pa.array([p.segment.finish_reason if isinstance(p.segment, TokenSegment) else None
                                   for p in ps], pa.string()),
    }
    for name, (kind, attr) in SEGMENT_TENSORS.items():
        seg_cls = _SEGMENT_CLS[kind]
        cols[name] = tensor_chunks([getattr(p.segment, attr) if isinstance(p.segment, seg_cls) else None
                                    for p in ps], name)
    cols["conditions"] = _conditions_column(ps)
    cols["media"] = pa.array([p.media for p in ps], pa.large_binary())
    cols["text"] = pa.array([p.text for p in ps], pa.large_string())
    cols["rewards"] = pa.array([list(p.rewards.items()) for p in ps], pa.map_(pa.string(), pa.float64()))
    cols["reward"] = pa.array([p.reward for p in ps], pa.float64())
    cols["valid"] = pa.array([p.valid for p in ps], pa.bool_())
    cols["advantage"] = pa.array([p.advantage for p in ps], pa.float64())
    cols["policy_version"] = pa.array([p.policy_version for p in ps], pa.int64())
    schema = batch_schema(batch.metadata)
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def _sampling_json(parts: list[Part]) -> list[str | None]:
    memo: dict[int, str | None] = {}  # siblings share one frozen params object: encode it once
    out = []
    for p in parts:
        key = id(p.sampling)
        if key not in memo:
            memo[key] = sampling_to_json(p.sampling)
        out.append(memo[key])
    return out


def _map_rows(col: pa.ChunkedArray) -> list[dict]:
    return [dict(v) if v is not None else {} for v in col.to_pylist()]


_PY_COLUMNS = ("sample_id", "group_id", "part_index", "kind", "parent", "prompt", "image", "sampling",
               "finish_reason", "media", "text", "reward", "valid", "advantage", "policy_version")


def _decode(source: str, column: str, fn):
    """Run ``fn``; any failure but a SchemaError becomes a SchemaError naming the file and ``column``."""
    try:
        return fn()
    except SchemaError:
        raise
    except Exception as e:  # a damaged value must never escape as an untyped error
        raise SchemaError(f"{source}: column '{column}' cannot be decoded ({type(e).__name__}: {e}); the file is "
                          "damaged or was not written by unirl_core.io.write_batch - re-write it") from e


def table_to_batch(table: pa.Table, *, source: str = "<table>", reader: TensorReader | None = None,
                   validate: bool = True) -> SampleBatch:
    """Decode a table written by ``batch_to_table``; tensors view ``reader``'s mapped file where possible.

    ``validate`` runs Arrow's full validation (offsets, UTF-8, null counts) first, so no row is read
    out of bounds; pass False only for a table that was just validated.
    """
    meta = check_schema(table.schema, source)
    if validate:
        try:
            table.validate(full=True)
        except (pa.ArrowException, ValueError) as e:
            raise SchemaError(f"{source}: the Arrow data fails validation ({e}); the file is damaged") from e
    reader = reader or TensorReader(source, None)
    py = {name: _decode(source, name, table.column(name).to_pylist) for name in _PY_COLUMNS}
    targets = _decode(source, "targets", lambda: _map_rows(table.column("targets")))
    rewards = _decode(source, "rewards", lambda: _map_rows(table.column("rewards")))
    tensors = {name: _decode(source, name, lambda name=name: reader.column(table.column(name), name))
               for name in SEGMENT_TENSORS}
    conditions = _decode(source, "conditions", lambda: _read_conditions(table.column("conditions"), reader))
    sampling_memo: dict[str | None, object] = {}  # rows of one batch usually share one JSON string
    samples: list[Sample] = []
    current: list[Part] = []
    for r in range(table.num_rows):
        try:
            part = _part(r, py, targets, rewards, tensors, conditions, source, sampling_memo)
        except SchemaError:
            raise
        except UniRLError as e:
            raise SchemaError(f"{source}: row {r} (sample {py['sample_id'][r]!r}) violates an invariant: {e}") from e
        except Exception as e:  # e.g. a damaged value of a type the Part constructor rejects
            raise SchemaError(f"{source}: row {r} (sample {py['sample_id'][r]!r}) cannot be decoded "
                              f"({type(e).__name__}: {e}); the file is damaged - re-write it") from e
        if py["part_index"][r] == 0 and current:
            samples.append(_sample(current, source))
            current = []
        if py["part_index"][r] != len(current):
            raise SchemaError(f"{source}: column 'part_index' row {r} is {py['part_index'][r]}, expected "
                              f"{len(current)}; parts of a sample must be stored contiguously in order")
        current.append(part)
    if current:
        samples.append(_sample(current, source))
    try:
        return SampleBatch(samples=samples, metadata=meta)
    except UniRLError as e:
        raise SchemaError(f"{source}: {e}") from e


def _read_conditions(col: pa.ChunkedArray, reader: TensorReader) -> list[dict]:
    out: list[dict] = []
    for chunk in col.chunks:
        flat = chunk.flatten()
        names = flat.field("name").to_pylist()
        values = reader.column(flat.field("tensor"), "conditions")
        offs = chunk.offsets.to_pylist()
        base = offs[0]
        for a, b in zip(offs, offs[1:]):
            out.append({names[k - base]: values[k - base] for k in range(a, b)})
    return out


def _part(r, py, targets, rewards, tensors, conditions, source, sampling_memo) -> Part:
    kind = py["kind"][r]
    segment = None
    seg_cls = _SEGMENT_CLS.get(kind)
    if seg_cls is not None:
        vals = {attr: tensors[name][r] for name, (k, attr) in SEGMENT_TENSORS.items() if k == kind}
        present = [v is not None for v in vals.values()]
        if any(present) and not all(present):
            missing = [a for a, v in vals.items() if v is None]
            raise SchemaError(f"{source}: row {r}: segment columns {missing} are null while others are set")
        if all(present):
            if seg_cls is TokenSegment:
                vals["finish_reason"] = py["finish_reason"][r]
            segment = seg_cls(**vals)
    return Part(kind=kind, sample_id=py["sample_id"][r], group_id=py["group_id"][r], parent=py["parent"][r],
                prompt=py["prompt"][r], image=py["image"][r], targets=targets[r],
                sampling=_sampling(py["sampling"][r], source, r, sampling_memo), segment=segment,
                conditions=conditions[r], media=py["media"][r], text=py["text"][r], rewards=rewards[r],
                reward=py["reward"][r], valid=py["valid"][r], advantage=py["advantage"][r],
                policy_version=py["policy_version"][r])


def _sampling(text: str | None, source: str, row: int, memo: dict):
    if text not in memo:  # sampling_from_json wraps its own failures (column 'sampling')
        memo[text] = sampling_from_json(text, source, row)  # frozen dataclass: safe to share
    return memo[text]


def _sample(parts: list[Part], source: str) -> Sample:
    try:
        return Sample(sample_id=parts[0].sample_id, group_id=parts[0].group_id, parts=parts)
    except UniRLError as e:
        raise SchemaError(f"{source}: {e}") from e
