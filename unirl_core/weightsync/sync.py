"""Trainer -> engine weight broadcast over a dedicated process group (NCCL on CUDA, gloo on CPU).

Rank 0 of the train job (the *sender*) and one or more engine processes (*receivers*) rendezvous on
their own TCP store (``master_addr:master_port``, the sender hosts it) and build a process group that
is **not** the default one: the train ranks keep their torchrun/FSDP group, the engines never join it.

One sync, on the wire (all broadcasts from rank 0 of the sync group):
1. header length (int64 ``[1]``), then the header: JSON as a uint8 tensor ``[n]`` - protocol, kind
   (``weights`` / ``close``), policy version, scope, bucket size and ``[name, shape, dtype]`` per tensor;
2. an all-reduce of two int32 per rank: receivers vote 1 when the header does not fit their module
   (name / shape / dtype), so every side stops cleanly before any bucket travels, and 1 when the header offers a
   delta against a version they do not hold bitwise (then the full weights travel instead);
3. the tensors, packed into flat per-dtype buffers of at most ``bucket_mb`` (``plan_buckets``: a tensor
   larger than a bucket travels alone), one broadcast per bucket; receivers copy views of each bucket
   into their parameters in place, by name;
4. a final all-reduce: ``send`` returns only once every engine holds the new version (after a delta that some
   engine could not reproduce, 3-4 once more with the full weights).

A sender built with ``deltas=True`` keeps the last version it sent and offers the next one as a delta against it
(``delta.py``: per tensor the changed positions, or a bitmap of them, and their new bit patterns); its header
carries every tensor's digest, which receivers check after applying a delta or receiving full weights.

Both sides derive the bucket layout from the header with the same pure function, so buckets carry no
metadata of their own. The group itself (rendezvous, collectives, timeouts): ``group.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Self

import torch
import torch.distributed as dist
from torch import Tensor, nn

from unirl_core.errors import ConfigError, field_error
from unirl_core.weightsync import delta as wire_delta
from unirl_core.weightsync.group import (  # noqa: F401  (WeightSyncConfig re-exported: importers use this module)
    SyncGroup, WeightSyncConfig, sync_device)
from unirl_core.weightsync.wire import (  # noqa: F401  (the wire format, re-exported: importers use this module)
    _DTYPES, _LORA_TAG, PROTOCOL, Bucket, Cast, SyncScope, TensorSpec, WeightSyncError, WeightSyncTimeout, check_names,
    check_specs, decode_header, encode_header, plan_buckets, spec_of, specs_of_header, sync_names, weights_header)

log = logging.getLogger(__name__)

def gather_for_sync(module: nn.Module, scope: SyncScope = "full") -> dict[str, Tensor]:
    """The trainer's tensors to send, by wire name (LoRA keys without peft's adapter name).

    Under FSDP2 this is a collective (every train rank must call it): full tensors are gathered to CPU
    on rank 0 (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), other ranks get ``{}``.
    A plain module returns detached views of its own tensors (no copy).
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = module.state_dict()
    state = {k: v.detach() for k, v in state.items()}
    if scope == "lora":
        state = {k.replace(_LORA_TAG, "."): v for k, v in state.items() if "lora_" in k}
    return state


def sync_sources(module: nn.Module, scope: SyncScope = "full") -> dict[str, Tensor]:
    """The trainer's tensors to send, by wire name, WITHOUT gathering: under FSDP2 they stay DTensor shards
    on the module's device, and ``send`` / ``follow_send`` gather each one (``full_tensor``) only while its
    bucket is packed, so a publish holds at most one bucket plus one full tensor beyond the shards
    (``gather_for_sync`` instead copies the whole state to rank 0's CPU first)."""
    if scope == "trainable":
        return {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    state = {k: v.detach() for k, v in module.state_dict().items()}
    if scope == "lora":
        state = {k.replace(_LORA_TAG, "."): v for k, v in state.items() if "lora_" in k}
    return state


def _full(t: Tensor) -> Tensor:
    """``t`` whole: a DTensor is gathered on its own device (a collective of its mesh), others as they are."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _is_sharded(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _wire_dtype(name: str, t: Tensor, cast: Cast) -> torch.dtype:
    if cast is None or not t.is_floating_point():
        return t.dtype
    if isinstance(cast, torch.dtype):
        return cast
    return cast.get(name, t.dtype)


def _wire_plan(state: Mapping[str, Tensor], cast: Cast, bucket_bytes: int,
               direct_bytes: int) -> tuple[list[str], list[TensorSpec], list[Bucket]]:
    """Names, wire specs (global shapes, wire dtypes) and buckets of one sync; the same on every train rank."""
    names = list(state)
    specs = []
    for n in names:
        dtype = str(_wire_dtype(n, state[n], cast)).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise field_error(WeightSyncError, f"weights[{n!r}].dtype", dtype, f"one of {sorted(_DTYPES)}",
                              "cast the tensor before syncing")
        specs.append(TensorSpec(n, tuple(int(x) for x in state[n].shape), dtype))
    return names, specs, plan_buckets(specs, bucket_bytes, direct_bytes)


def follow_send(state: Mapping[str, Tensor], *, cast: Cast = None, bucket_bytes: int, direct_bytes: int,
                verdict: Tensor, deltas: bool = False) -> None:
    """A train rank other than 0 of a sharded trainer during ``WeightSender.send(..., train_group=True)``:
    receives rank 0's verdict on the header (``verdict``: an int32 ``[1]`` on the train group's device), then
    takes part in every ``full_tensor`` gather in the sender's order and drops the result. ``deltas``: the sender
    keeps its base (``WeightSender(deltas=True)``): it gathers every tensor once, in state order, before its header."""
    if deltas:
        for t in state.values():
            if _is_sharded(t):
                _full(t)
        dist.broadcast(verdict, src=0)
        return
    dist.broadcast(verdict, src=0)
    if int(verdict.item()):
        return
    names, _, buckets = _wire_plan(state, cast, bucket_bytes, direct_bytes)
    for b in buckets:
        for i, _, _ in b.entries:
            if _is_sharded(state[names[i]]):
                _full(state[names[i]])  # the sender gathers each tensor exactly once, in this order


# ------------------------------------------------------------------------------ the sync group


@dataclass(kw_only=True)
class SyncStats:
    """What one sync moved."""

    version: int
    num_tensors: int
    num_buckets: int
    bytes: int
    """Bytes of the buckets (the tensors, or a delta's pieces)."""
    seconds: float
    header_bytes: int = 0
    """Bytes of the header (its length and its JSON) this sync broadcast."""
    delta: bool = False
    """The version travelled as a delta against the one every receiver held."""
    resent_full: str | None = None
    """Set when the delta did not reproduce the version on some receiver and the same sync sent it again in full
    (then ``delta`` is False, ``bytes`` counts both rounds and ``num_buckets`` the full round's): the sender's count
    of receivers that failed, or a receiver's own error (naming the tensor)."""


def _direct_view(t: Tensor, bucket: Bucket, device: torch.device) -> Tensor | None:
    """A flat view of ``t`` when it alone fills ``bucket`` and already has the wire layout (contiguous, same
    dtype, on the sync device): it is then broadcast from / into in place, without a packing copy."""
    if len(bucket.entries) != 1 or bucket.numel == 0:
        return None
    if t.dtype != _DTYPES[bucket.dtype] or t.device != device or not t.is_contiguous():
        return None
    return t.detach().view(-1)


class WeightSender:
    """Trainer side (rank 0 of the train job): hosts the rendezvous, broadcasts weights after a step."""

    def __init__(self, cfg: WeightSyncConfig, *, device: str | torch.device = "cpu", deltas: bool = False) -> None:
        """``deltas``: keep the last version sent (one copy of the weights in their wire dtypes, on ``device``) and
        send each next version as a delta against it when every receiver holds it bitwise, full otherwise."""
        self.cfg = cfg
        self.group = SyncGroup(cfg, 0, sync_device(device))
        self.base = wire_delta.SentBase(self.group.device) if deltas else None

    def send(self, state: Mapping[str, Tensor], version: int, *, scope: SyncScope = "full",
             cast: Cast = None, bucket_mb: float | None = None, train_group: bool = False) -> SyncStats:
        """Broadcast ``state`` (wire name -> tensor, any device; DTensor shards are gathered bucket by bucket)
        as policy ``version``.

        ``cast`` converts floating-point tensors to the engine's dtype while packing (one dtype, or one per
        name); ``bucket_mb`` overrides the config's bucket size for this sync (the header carries it).
        ``train_group``: this is rank 0 of a sharded trainer whose other ranks call ``follow_send`` with the
        same state, cast and bucket sizes; the engines' verdict on the header goes to them over the default
        group, and each DTensor is gathered there collectively.
        Raises ``WeightSyncError`` when an engine rejects the header; no bucket has travelled then.
        With ``deltas`` every tensor is gathered and kept first, and the version travels from that copy: as a delta
        when every receiver holds the previous one bitwise (their votes), else in full.
        """
        t0 = time.perf_counter()
        bucket_bytes = self.cfg.bucket_bytes if bucket_mb is None else max(1, int(bucket_mb * 2**20))
        direct = self.cfg.direct_bytes
        names, specs, buckets = _wire_plan(state, cast, bucket_bytes, direct)
        header = weights_header(specs, version=version, scope=scope, bucket_bytes=bucket_bytes, direct_bytes=direct)
        pieces: list[Tensor] = []
        if self.base is not None:
            base_held = self.base.held
            modes, pieces, digests = self.base.update(
                names, specs, lambda i: _full(state[names[i]]).detach().to(_DTYPES[specs[i].dtype]))
            header["digests"] = digests
            self.base.held = (int(version), wire_delta.version_digest(names, digests))
            header["version_digest"] = self.base.held[1]
            if modes is not None and base_held is not None:
                header["delta"] = {"base_version": base_held[0], "base_digest": base_held[1], "modes": modes}
            state, cast = self.base.tensors, None  # a full send reads the copy
        header_bytes = self.group.send_header(header)
        rejects, lacking = self.group.votes(False, False)
        if train_group:
            dist.broadcast(torch.tensor([int(rejects > 0)], dtype=torch.int32, device=self.group.device), src=0)
        if rejects:
            raise field_error(WeightSyncError, "weight_sync.version", version,
                              "every engine to accept the header", f"{rejects} engine(s) refused it; "
                              "their logs name the tensor (model config, LoRA targets or dtype differ)")
        as_delta = "delta" in header and lacking == 0
        full = (names, state, specs, buckets)
        if as_delta:
            pspecs = delta_specs(specs, header["delta"]["modes"])
            buckets = plan_buckets(pspecs, bucket_bytes, direct)
            names, state, specs = [p.name for p in pspecs], dict(zip((p.name for p in pspecs), pieces)), pspecs
        total = self._send_buckets(buckets, names, state, specs)
        failed = self.group.vote(False)  # every engine has copied (or loaded) the buckets
        resent = None
        if failed and as_delta:
            # Every receiver saw the same count: the version travels again in full, from the kept copy, and each
            # receiver overwrites what it applied (its error names the tensor in its log).
            resent = f"{failed} engine(s) did not apply or reproduce the delta"
            log.warning("weight sync v%d: %s; sending it in full", version, resent)
            names, state, specs, buckets = full
            total += self._send_buckets(buckets, names, state, specs)
            as_delta = False
            failed = self.group.vote(False)
        if failed:
            raise field_error(WeightSyncError, "weight_sync.load", version, "every engine to load the version",
                              f"{failed} engine(s) failed to load it (their logs and errors name why); it is not "
                              "published to them")
        stats = SyncStats(version=version, num_tensors=len(header["tensors"]), num_buckets=len(buckets), bytes=total,
                          seconds=time.perf_counter() - t0, header_bytes=header_bytes, delta=as_delta,
                          resent_full=resent)
        log.info("weight sync v%d%s: %d tensors, %d buckets, %.1f MB in %.3f s", version,
                 " (delta)" if as_delta else " (delta, then full)" if resent else "", stats.num_tensors,
                 stats.num_buckets, total / 1e6, stats.seconds)
        return stats

    def _send_buckets(self, buckets, names: list[str], state: Mapping[str, Tensor], specs: list[TensorSpec]) -> int:
        total = 0
        with torch.no_grad():
            for b in buckets:
                buf = self._bucket(b, names, state, specs)
                self.group.broadcast(buf, f"bucket[{b.dtype}]")
                total += buf.numel() * buf.element_size()
                del buf
        return total

    def _bucket(self, b: Bucket, names: list[str], state: Mapping[str, Tensor], specs: list[TensorSpec]) -> Tensor:
        """The flat wire buffer of ``b``: a tensor that alone fills it and already has the wire layout is sent
        as it is; everything else (DTensors gathered just now) is cast and packed into a fresh buffer."""
        device = self.group.device
        buf = None
        for i, off, n in b.entries:
            whole = _full(state[names[i]]).detach()  # once per tensor: follow_send gathers in the same order
            if len(b.entries) == 1 and (direct := _direct_view(whole, b, device)) is not None:
                return direct
            if buf is None:
                buf = torch.empty(b.numel, dtype=_DTYPES[b.dtype], device=device)
            buf[off:off + n].copy_(whole.reshape(-1), non_blocking=True)
            del whole
        return buf if buf is not None else torch.empty(b.numel, dtype=_DTYPES[b.dtype], device=device)

    def close(self) -> None:
        """Tell every engine the stream ended (their ``receive`` returns None), then leave the group."""
        if self.group.pg is None:
            return
        try:
            self.group.send_header({"protocol": PROTOCOL, "kind": "close"})
        finally:
            self.group.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def delta_specs(specs: list[TensorSpec], modes: list[list]) -> list[TensorSpec]:
    """The wire tensors of a delta (``header["delta"]["modes"]``: [mode, changed count] per tensor)."""
    if len(modes) != len(specs) or any(m[0] not in wire_delta.MODES for m in modes):
        raise field_error(WeightSyncError, "weight_sync.header.delta.modes", modes[:3],
                          f"one of {wire_delta.MODES} per tensor ({len(specs)})", "both ends must run this protocol")
    return [p for s, (mode, k) in zip(specs, modes) for p in wire_delta.piece_specs(s, mode, int(k))]


def accept_header(group: SyncGroup, check, holds_base=None) -> tuple[dict, list[TensorSpec], float, bool] | None:
    """A receiver's side of steps 1-2 of a sync: the header, ``check(header, specs)`` (raising
    ``WeightSyncError``), the votes. Returns (header, specs, the perf_counter after the header, whether the buckets
    are a delta) or None when the sender closed the stream; a foreign or refused header votes "refuse" (the sender
    fails instead of hanging). ``holds_base(header)``: whether this receiver holds the delta's base bitwise (None:
    never; the sender then sends full weights)."""
    try:
        header = group.recv_header()
    except WeightSyncTimeout:
        raise
    except WeightSyncError:
        group.votes(True, True)
        raise
    t0 = time.perf_counter()
    if header.get("kind") == "close":
        return None
    specs = specs_of_header(header)
    try:
        check(header, specs)
    except WeightSyncError:
        group.votes(True, True)
        raise
    offered = "delta" in header
    lacks = offered and (holds_base is None or not holds_base(header))
    rejects, lacking = group.votes(False, lacks)
    if rejects:
        raise field_error(WeightSyncError, "weight_sync.version", header["version"],
                          "every engine to accept the header", "another engine refused it (see its log)")
    return header, specs, t0, offered and lacking == 0


class WeightReceiver:
    """Engine side: joins the sync group as ``rank`` (1..num_engines) and loads weights into ``module``."""

    def __init__(self, cfg: WeightSyncConfig, module: nn.Module, *, rank: int = 1, scope: SyncScope = "full",
                 device: str | torch.device = "cpu") -> None:
        if not (isinstance(rank, int) and 1 <= rank <= cfg.num_engines):
            raise field_error(ConfigError, "weight_sync.rank", rank, f"an engine rank in 1..{cfg.num_engines}",
                              "rank 0 is the trainer's sender")
        self.cfg, self.module, self.scope = cfg, module, scope
        self.targets = sync_names(module, scope)
        self.version: int | None = None
        """Policy version of the weights the module now holds (None before the first sync)."""
        self.held: tuple[int, str] | None = None
        """(version, version digest) the module holds bitwise, as a delta's header names its base."""
        self.group = SyncGroup(cfg, rank, sync_device(device))

    def forget(self) -> None:
        """The module's weights were changed by something else than this receiver: it holds no version a delta
        could apply to (its next sync is full)."""
        self.held = None

    def receive(self) -> SyncStats | None:
        """Block for the next sync; copy it (or apply its delta) into the module in place. None when the sender
        closed. A delta that does not reproduce the sender's digests on any receiver (this one's error names the
        tensor) makes the same sync send the version again in full (``SyncStats.resent_full``); full weights that
        do not reproduce them raise ``WeightSyncError`` naming the tensor, after the sender heard of it (the final
        vote), and the module then holds no version."""
        def check(header: dict, specs: list[TensorSpec]) -> None:
            if header.get("scope") != self.scope:
                raise field_error(WeightSyncError, "weight_sync.scope", header.get("scope"), repr(self.scope),
                                  "sender and receiver must agree on full weights vs a LoRA adapter")
            check_specs(specs, self.targets)

        def holds_base(header: dict) -> bool:
            d = header["delta"]
            return self.held == (d["base_version"], d["base_digest"])

        accepted = accept_header(self.group, check, holds_base)
        if accepted is None:
            return None
        header, specs, t0, as_delta = accepted
        self.held, self.version = None, None  # from the first bucket on the module holds no complete version
        wire = delta_specs(specs, header["delta"]["modes"]) if as_delta else specs
        buckets = plan_buckets(wire, int(header["bucket_bytes"]), header.get("direct_bytes"))
        total, failure = self._receive_and_check(header, specs, wire, buckets, as_delta)
        failed = self.group.vote(failure is not None)
        resent = None
        if failed and as_delta:  # some receiver (maybe not this one) failed the delta: the version comes in full
            resent = str(failure) if failure is not None else \
                f"{failed} other engine(s) did not apply or reproduce the delta"
            if failure is not None:
                log.warning("weight sync v%s: %s; receiving it in full", header["version"], failure)
            buckets = plan_buckets(specs, int(header["bucket_bytes"]), header.get("direct_bytes"))
            more, failure = self._receive_and_check(header, specs, specs, buckets, False)
            total, as_delta = total + more, False
            self.group.vote(failure is not None)
        if failure is not None:
            raise failure
        self.version = int(header["version"])
        if "version_digest" in header:
            self.held = (self.version, header["version_digest"])
        return SyncStats(version=self.version, num_tensors=len(specs), num_buckets=len(buckets), bytes=total,
                         seconds=time.perf_counter() - t0, delta=as_delta, resent_full=resent)

    def _receive_and_check(self, header: dict, specs: list[TensorSpec], wire: list[TensorSpec], buckets,
                           as_delta: bool) -> tuple[int, WeightSyncError | None]:
        """Receive the buckets (full weights into the targets, or a delta applied to them), check the sender's
        digests; the bytes received and the failure to vote on (None: the module holds the version bitwise)."""
        failure: WeightSyncError | None = None
        with torch.no_grad():
            total, pieces = self._receive_buckets(wire, buckets, keep=as_delta)
            if self.group.device.type == "cuda":
                torch.cuda.synchronize(self.group.device)
            try:
                if as_delta:
                    self._apply_delta(specs, header["delta"]["modes"], pieces)
                if "digests" in header:
                    self._check_digests(specs, header["digests"])
            except WeightSyncError as e:
                failure = e
            except Exception as e:  # voted too, so the sender fails at once instead of waiting out timeout_s
                failure = field_error(WeightSyncError, "weight_sync.receive", f"{type(e).__name__}: {e}",
                                      "a version applied and checked", "the engine holds no version now (after a "
                                      "delta the same sync sends the version in full)")
                failure.__cause__ = e
        return total, failure

    def _receive_buckets(self, wire: list[TensorSpec], buckets, *, keep: bool) -> tuple[int, dict[str, Tensor]]:
        """Receive every bucket: full weights are copied into the targets by name (a bucket of one target with the
        wire layout is received straight into it); a delta's pieces (``keep``) are returned by wire name."""
        total, pieces = 0, {}
        for b in buckets:
            first = wire[b.entries[0][0]].name
            direct = None if keep else _direct_view(self.targets[first], b, self.group.device)
            buf = direct if direct is not None else torch.empty(b.numel, dtype=_DTYPES[b.dtype],
                                                                device=self.group.device)
            self.group.broadcast(buf, f"bucket[{b.dtype}]")
            if direct is None:
                for i, off, n in b.entries:
                    s = wire[i]
                    if keep:
                        pieces[s.name] = buf[off:off + n]
                    else:
                        self.targets[s.name].copy_(buf[off:off + n].view(s.shape))
            total += buf.numel() * buf.element_size()
        return total, pieces

    def _apply_delta(self, specs: list[TensorSpec], modes: list[list], pieces: dict[str, Tensor]) -> None:
        for s, (mode, k) in zip(specs, modes):
            got = [pieces[p.name] for p in wire_delta.piece_specs(s, mode, int(k))]
            wire_delta.apply(s.name, self.targets[s.name], mode, int(k), got)

    def _check_digests(self, specs: list[TensorSpec], digests: list[list[int]]) -> None:
        for s, want in zip(specs, digests, strict=True):
            got = wire_delta.tensor_digest(self.targets[s.name])
            if got != list(want):
                raise field_error(WeightSyncError, f"weight_sync.tensors[{s.name!r}].digest", got,
                                  f"{list(want)} (the sender's)", "the engine's copy of the base version differs "
                                  "from the trainer's (its weights were changed outside the sync?) or the bytes were "
                                  "damaged; after a delta the same sync sends the version in full, after full weights "
                                  "the engine holds no version and the publish fails")

    def close(self) -> None:
        if self.group.pg is not None:
            self.group.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
