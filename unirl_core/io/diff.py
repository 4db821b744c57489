"""Where two batches differ, bit for bit: the first field (in the Arrow schema's names) and the row.

Replay compares a recomputed step with the batch the run stored (``unirl_core/runs/replay.py``). The fields are
walked in the order the loop fills them - what the rollout wrote, then the reward phase's, then the advantage - so
the first difference points at the earliest phase that diverged. Tensors are compared as raw bytes (dtype and
shape first), floats by their IEEE bits (a NaN equals the same NaN; -0.0 differs from 0.0).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from unirl_core.io.schema import SEGMENT_TENSORS, sampling_to_json
from unirl_core.types import Part, SampleBatch, TokenSegment

ROLLOUT_FIELDS: tuple[tuple[str, Callable[[Part], object]], ...] = (
    ("kind", lambda p: p.kind),
    ("parent", lambda p: p.parent),
    ("prompt", lambda p: p.prompt),
    ("image", lambda p: p.image),
    ("targets", lambda p: dict(p.targets)),
    ("sampling", lambda p: sampling_to_json(p.sampling)),
    ("finish_reason", lambda p: p.segment.finish_reason if isinstance(p.segment, TokenSegment) else None),
    *((name, (lambda p, kind=kind, attr=attr: getattr(p.segment, attr, None)
              if p.segment is not None and _segment_kind(p) == kind else None))
      for name, (kind, attr) in SEGMENT_TENSORS.items()),
    ("conditions", lambda p: dict(p.conditions)),
    ("media", lambda p: p.media),
    ("text", lambda p: p.text),
    ("policy_version", lambda p: p.policy_version),
)
"""What the rollout phase writes into a Part, in schema order."""
REWARD_FIELDS = (("rewards", lambda p: dict(p.rewards)), ("reward", lambda p: p.reward), ("valid", lambda p: p.valid))
ADVANTAGE_FIELDS = (("advantage", lambda p: p.advantage),)


def _segment_kind(p: Part) -> str:
    return "ar" if isinstance(p.segment, TokenSegment) else "diffusion"


@dataclasses.dataclass(frozen=True)
class Difference:
    """One field that differs: its name, where (sample / part, or a batch metadata key) and both values."""

    field: str
    where: str
    stored: object
    replayed: object

    def __str__(self) -> str:
        return f"{self.field} ({self.where}): stored {_show(self.stored)}, replayed {_show(self.replayed)}"


def _show(v: object) -> str:
    if isinstance(v, Tensor):
        flat = v.detach().reshape(-1)
        head = ", ".join(f"{x:.6g}" for x in flat[:4].float().tolist()) if flat.numel() else ""
        return f"tensor({v.dtype}, shape {tuple(v.shape)}, [{head}{', ...' if flat.numel() > 4 else ''}])"
    text = repr(v)
    return text if len(text) <= 120 else text[:120] + "..."


def same_bits(a: object, b: object) -> bool:
    """Bitwise equality of JSON-like values, tensors and bytes (nested dicts / lists / tuples walked)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_raw(a), _raw(b))
    if isinstance(a, float) or isinstance(b, float):
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float))) or isinstance(a, bool) \
                or isinstance(b, bool):
            return False
        return struct.pack("<d", float(a)) == struct.pack("<d", float(b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _raw(t: Tensor) -> Tensor:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def first_difference(stored: SampleBatch, replayed: SampleBatch, *,
                     ignore_metadata: tuple[str, ...] = ()) -> Difference | None:
    """The first field in which ``replayed`` differs from ``stored`` (rollout fields of every row, then rewards,
    then advantages, then the batch metadata but the keys in ``ignore_metadata``), or None when they are bitwise
    equal."""
    if len(stored) != len(replayed):
        return Difference("samples", "batch", len(stored), len(replayed))
    rows = [(f"sample {a.sample_id!r} part {i}", pa, pb)
            for a, b in zip(stored.samples, replayed.samples, strict=True)
            for i, (pa, pb) in enumerate(zip(a.parts, b.parts, strict=False))]
    for a, b in zip(stored.samples, replayed.samples, strict=True):
        for name in ("sample_id", "group_id"):
            if getattr(a, name) != getattr(b, name):
                return Difference(name, f"sample {a.sample_id!r}", getattr(a, name), getattr(b, name))
        if len(a.parts) != len(b.parts):
            return Difference("part_index", f"sample {a.sample_id!r}", len(a.parts), len(b.parts))
    for fields in (ROLLOUT_FIELDS, REWARD_FIELDS, ADVANTAGE_FIELDS):
        for name, get in fields:
            for where, pa, pb in rows:
                va, vb = get(pa), get(pb)
                if not same_bits(va, vb):
                    return Difference(name, where, va, vb)
    for key in sorted((set(stored.metadata) | set(replayed.metadata)) - set(ignore_metadata)):
        va, vb = stored.metadata.get(key), replayed.metadata.get(key)
        if va != vb:
            return Difference(f"metadata[{key!r}]", "batch", va, vb)
    return None
