"""The trainer -> engine weight sync's wire format: tensor specs, the bucket plan and the JSON header, plus the
name / shape / dtype checks a receiver runs on a header before any bucket travels. Pure functions of the header,
so sender and receivers derive the same layout (``weight_sync`` holds the protocol's steps and the groups)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from unirl_core.errors import EngineError, field_error

PROTOCOL = 2  # 2: the header vote carries two flags (refuse, lacks the delta's base)
SyncScope = Literal["full", "lora", "trainable"]
"""``full``: every state-dict entry; ``lora``: the adapter, keys without peft's adapter name; ``trainable``: the
parameters with ``requires_grad``, by module name (the pool's scope: what ``TrainBackend.model_state_dict`` holds)."""
Cast = torch.dtype | Mapping[str, torch.dtype] | None
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}
_LORA_TAG = ".default."  # peft's adapter name inside state-dict keys (unirl_core.models.lora.ADAPTER_NAME)


class WeightSyncError(EngineError):
    """The sender's tensors do not fit the receiver's module (name, shape or dtype), or the peer misbehaved."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A rendezvous or collective of the sync group did not finish within ``timeout_s``."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor on the wire."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=_DTYPES[self.dtype]).element_size()


@dataclass(frozen=True)
class Bucket:
    """One flat buffer of a single dtype: ``entries`` are (tensor index, element offset, numel)."""

    dtype: str
    numel: int
    entries: tuple[tuple[int, int, int], ...]


def spec_of(name: str, t: Tensor) -> TensorSpec:
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise field_error(WeightSyncError, f"weights[{name!r}].dtype", dtype, f"one of {sorted(_DTYPES)}",
                          "cast the tensor before syncing")
    return TensorSpec(name, tuple(int(s) for s in t.shape), dtype)


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int, direct_bytes: int | None = None) -> list[Bucket]:
    """Group tensors per dtype (first-seen order) into buffers of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes``, or of at least ``direct_bytes``, gets a bucket of its own (exactly
    its size); zero-size tensors ride along without taking space. Deterministic: sender and receivers
    compute the same plan from the header.
    """
    order: list[str] = []
    by_dtype: dict[str, list[int]] = {}
    for i, s in enumerate(specs):
        if s.dtype not in by_dtype:
            order.append(s.dtype)
            by_dtype[s.dtype] = []
        by_dtype[s.dtype].append(i)
    buckets: list[Bucket] = []
    for dtype in order:
        item = torch.empty((), dtype=_DTYPES[dtype]).element_size()
        cap = max(1, bucket_bytes // item)
        entries: list[tuple[int, int, int]] = []
        used = 0
        for i in by_dtype[dtype]:
            n = specs[i].numel
            if direct_bytes is not None and n * item >= direct_bytes:
                buckets.append(Bucket(dtype, n, ((i, 0, n),)))
                continue
            if entries and used + n > cap:
                buckets.append(Bucket(dtype, used, tuple(entries)))
                entries, used = [], 0
            entries.append((i, used, n))
            used += n
        if entries:
            buckets.append(Bucket(dtype, used, tuple(entries)))
    return buckets


def encode_header(header: dict) -> Tensor:
    """JSON header -> uint8 tensor ``[n]``."""
    return torch.frombuffer(bytearray(json.dumps(header, separators=(",", ":")).encode()), dtype=torch.uint8)


def decode_header(payload: Tensor) -> dict:
    """uint8 tensor ``[n]`` -> header dict; raises ``WeightSyncError`` on a foreign payload or protocol."""
    try:
        header = json.loads(bytes(payload.cpu().numpy().tobytes()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise field_error(WeightSyncError, "weight_sync.header", type(e).__name__, "a JSON header",
                          "both ends must run this module's protocol") from e
    if header.get("protocol") != PROTOCOL:
        raise field_error(WeightSyncError, "weight_sync.header.protocol", header.get("protocol"), PROTOCOL,
                          "run the same library version on the trainer and the engines")
    return header


def weights_header(specs: list[TensorSpec], *, version: int, scope: SyncScope, bucket_bytes: int,
                   direct_bytes: int | None = None) -> dict:
    return {"protocol": PROTOCOL, "kind": "weights", "version": int(version), "scope": scope,
            "bucket_bytes": int(bucket_bytes), "direct_bytes": direct_bytes, "tensors": [[s.name, list(s.shape), s.dtype] for s in specs]}


def specs_of_header(header: dict) -> list[TensorSpec]:
    return [TensorSpec(n, tuple(shape), dt) for n, shape, dt in header["tensors"]]


def sync_names(module: nn.Module, scope: SyncScope) -> dict[str, Tensor]:
    """The receiver's in-place targets by wire name: every state-dict entry, or the LoRA adapter only
    (keys without peft's adapter name, as ``unirl_core.models.lora.lora_state_dict`` writes them)."""
    if scope == "trainable":
        out = {n: p for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
        if not out:
            raise field_error(WeightSyncError, "weight_sync.scope", scope, f"trainable parameters in "
                              f"{type(module).__name__}", "mark the trainer's trainable parameters (or its LoRA "
                              "layers) on the engine's module too")
        return out
    state = module.state_dict(keep_vars=True)
    if scope == "full":
        return dict(state)
    out = {k.replace(_LORA_TAG, "."): v for k, v in state.items() if "lora_" in k}
    if not out:
        raise field_error(WeightSyncError, "weight_sync.scope", scope, f"LoRA layers in {type(module).__name__}",
                          "apply_lora with the trainer's rank and targets before receiving an adapter")
    return out


def check_names(specs: list[TensorSpec], known, required, *, unknown: tuple[str, str],
                missing: tuple[str, str]) -> None:
    """Raise ``WeightSyncError`` naming the first tensors sent that are not ``known`` or ``required`` ones not
    sent; ``unknown`` / ``missing``: (what was expected, the fix) of each error."""
    sent = {s.name for s in specs}
    extra = [s.name for s in specs if s.name not in known]
    if extra:
        raise field_error(WeightSyncError, "weight_sync.tensors", extra[:5], *unknown)
    lacking = [n for n in required if n not in sent]
    if lacking:
        raise field_error(WeightSyncError, "weight_sync.tensors", lacking[:5], *missing)


def check_specs(specs: list[TensorSpec], targets: Mapping[str, Tensor]) -> None:
    """Raise ``WeightSyncError`` naming the first tensor whose name, shape or dtype does not fit ``targets``."""
    check_names(specs, targets, targets,
                unknown=("names of the engine's module",
                         "trainer and engine must load the same architecture (and LoRA targets)"),
                missing=("a tensor for every target", "sync the same scope (full / lora) the engine expects"))
    for s in specs:
        t = targets[s.name]
        if tuple(t.shape) != s.shape:
            raise field_error(WeightSyncError, f"weight_sync.tensors[{s.name!r}].shape", s.shape,
                              f"{tuple(t.shape)} (engine)", "trainer and engine model configs differ")
        if str(t.dtype).removeprefix("torch.") != s.dtype:
            raise field_error(WeightSyncError, f"weight_sync.tensors[{s.name!r}].dtype", s.dtype,
                              f"{str(t.dtype).removeprefix('torch.')} (engine)",
                              "cast on the sender (send(..., cast=...)) or load the engine in the trainer's dtype")
