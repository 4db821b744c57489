"""Trainer -> engine weight broadcast over a dedicated process group (NCCL on CUDA, gloo on CPU).

Rank 0 of the train job (the *sender*) and one or more engine processes (*receivers*) rendezvous on
their own TCP store (``master_addr:master_port``, the sender hosts it) and build a process group that
is **not** the default one: the train ranks keep their torchrun/FSDP group, the engines never join it.

One sync, on the wire (all broadcasts from rank 0 of the sync group):
1. header length (int64 ``[1]``), then the header: JSON as a uint8 tensor ``[n]`` - protocol, kind
   (``weights`` / ``close``), policy version, scope, bucket size and ``[name, shape, dtype]`` per tensor;
2. an all-reduce of one int32 per rank: receivers vote 1 when the header does not fit their module
   (name / shape / dtype), so every side stops cleanly before any bucket travels;
3. the tensors, packed into flat per-dtype buffers of at most ``bucket_mb`` (``plan_buckets``: a tensor
   larger than a bucket travels alone), one broadcast per bucket; receivers copy views of each bucket
   into their parameters in place, by name;
4. a final all-reduce: ``send`` returns only once every engine holds the new version.

Both sides derive the bucket layout from the header with the same pure function, so buckets carry no
metadata of their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Self

import torch
import torch.distributed as dist
from torch import Tensor, nn

from unirl_core.errors import ConfigError, check_ints, field_error
from unirl_core.weightsync.wire import (  # noqa: F401  (the wire format, re-exported: importers use this module)
    _DTYPES, _LORA_TAG, PROTOCOL, Bucket, Cast, SyncScope, TensorSpec, WeightSyncError, WeightSyncTimeout, check_names,
    check_specs, decode_header, encode_header, plan_buckets, spec_of, specs_of_header, sync_names, weights_header)

log = logging.getLogger(__name__)

SyncBackend = Literal["auto", "nccl", "gloo"]


@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    """Where the sync group meets and how tensors are batched on the wire."""

    master_addr: str = "127.0.0.1"
    """Host of the sender (rank 0 of the sync group), which serves the TCP rendezvous store."""
    master_port: int = 29650
    """Port of the rendezvous store; must differ from the train job's MASTER_PORT."""
    num_engines: int = 1
    """Receiver processes (engine ranks 1..num_engines); the group has ``num_engines + 1`` ranks."""
    backend: SyncBackend = "auto"
    """``auto``: ``nccl`` when the sync device is CUDA, else ``gloo``; or force one of them."""
    bucket_mb: float = 256.0
    """Upper size of one flat per-dtype buffer (MiB); fewer, larger broadcasts cut launch overhead."""
    direct_mb: float = 8.0
    """Tensors of at least this size (MiB) skip packing: each is one broadcast straight from the trainer's
    tensor into the engine's parameter (when both are contiguous on the sync device), saving two copies."""
    timeout_s: float = 300.0
    """Rendezvous and per-collective timeout; a peer that vanishes surfaces as ``WeightSyncTimeout``."""

    def __post_init__(self) -> None:
        if not (isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            raise field_error(ConfigError, "weight_sync.master_port", self.master_port, "a TCP port in 1..65535",
                              "pick a free port other than the train job's MASTER_PORT")
        check_ints("weight_sync", self, ("num_engines",), "count the engine processes that receive weights")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise field_error(ConfigError, "weight_sync.backend", self.backend, "'auto', 'nccl' or 'gloo'",
                              "use 'auto' (nccl on CUDA, gloo on CPU)")
        for name in ("bucket_mb", "direct_mb", "timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise field_error(ConfigError, f"weight_sync.{name}", v, "a number > 0",
                                  "use e.g. bucket_mb=256, timeout_s=300")

    @property
    def world_size(self) -> int:
        return self.num_engines + 1

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def direct_bytes(self) -> int:
        return max(1, int(self.direct_mb * 2**20))


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
                verdict: Tensor) -> None:
    """A train rank other than 0 of a sharded trainer during ``WeightSender.send(..., train_group=True)``:
    receives rank 0's verdict on the header (``verdict``: an int32 ``[1]`` on the train group's device), then
    takes part in every ``full_tensor`` gather in the sender's order and drops the result."""
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
    seconds: float


def resolve_backend(backend: SyncBackend, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise field_error(ConfigError, "weight_sync.backend", backend, "a CUDA sync device for nccl",
                          "use backend='gloo' (or 'auto') on CPU")
    return backend


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, TimeoutError) or "timed out" in text or "timeout" in text


class _SyncGroup:
    """A process group of its own (not the default one), on a TCP store hosted by rank 0."""

    def __init__(self, cfg: WeightSyncConfig, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.backend = resolve_backend(cfg.backend, device)
        timeout = timedelta(seconds=cfg.timeout_s)
        where = f"{cfg.master_addr}:{cfg.master_port}"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            store = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, is_master=rank == 0,
                                  timeout=timeout, wait_for_workers=True)
            store = dist.PrefixStore("unirl_weight_sync", store)
            self.pg = self._make_pg(store, timeout)
        except Exception as e:  # torch raises DistNetworkError / DistStoreError / RuntimeError here
            cls = WeightSyncTimeout if _is_timeout(e) else WeightSyncError
            raise field_error(cls, "weight_sync.rendezvous", where,
                              f"{cfg.world_size} ranks within {cfg.timeout_s} s (rank {rank}: {e})",
                              "start the trainer and every engine with the same master_addr/port/num_engines") from e
        log.info("weight-sync group: backend=%s rank=%d/%d at %s", self.backend, rank, cfg.world_size, where)

    def _make_pg(self, store, timeout: timedelta):
        size = self.cfg.world_size
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(store, self.rank, size, timeout)
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise field_error(ConfigError, "weight_sync.backend", "nccl", "a torch build with NCCL",
                              "use backend='gloo' on this build")
        opts = nccl.Options()
        opts._timeout = timeout
        return nccl(store, self.rank, size, opts)

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except Exception as e:  # c10d raises several unrelated types for one dead peer
            cls = WeightSyncTimeout if _is_timeout(e) else WeightSyncError
            raise field_error(cls, f"weight_sync.{what}", type(e).__name__,
                              f"all {self.cfg.world_size} ranks within {self.cfg.timeout_s} s ({e})",
                              "a peer died or stopped syncing; restart both sides") from e

    def broadcast(self, t: Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self._wait(self.pg.broadcast([t], opts), what)

    def vote(self, reject: bool) -> int:
        """Sum over ranks of ``reject`` (how many ranks refuse the header)."""
        t = torch.tensor([int(reject)], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._wait(self.pg.allreduce([t], opts), "vote")
        return int(t.item())

    def send_header(self, header: dict) -> None:
        payload = encode_header(header).to(self.device)
        self.broadcast(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device), "header_len")
        self.broadcast(payload, "header")

    def recv_header(self) -> dict:
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(n, "header_len")
        payload = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(payload, "header")
        return decode_header(payload)

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception as e:  # noqa: BLE001 - closing after a failed peer must not hide the original error
                log.warning("weight-sync group shutdown: %s", e)
        self.pg = None


def _direct_view(t: Tensor, bucket: Bucket, device: torch.device) -> Tensor | None:
    """A flat view of ``t`` when it alone fills ``bucket`` and already has the wire layout (contiguous, same
    dtype, on the sync device): it is then broadcast from / into in place, without a packing copy."""
    if len(bucket.entries) != 1 or bucket.numel == 0:
        return None
    if t.dtype != _DTYPES[bucket.dtype] or t.device != device or not t.is_contiguous():
        return None
    return t.detach().view(-1)


def _sync_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class WeightSender:
    """Trainer side (rank 0 of the train job): hosts the rendezvous, broadcasts weights after a step."""

    def __init__(self, cfg: WeightSyncConfig, *, device: str | torch.device = "cpu") -> None:
        self.cfg = cfg
        self.group = _SyncGroup(cfg, 0, _sync_device(device))

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
        """
        t0 = time.perf_counter()
        bucket_bytes = self.cfg.bucket_bytes if bucket_mb is None else max(1, int(bucket_mb * 2**20))
        direct = self.cfg.direct_bytes
        names, specs, buckets = _wire_plan(state, cast, bucket_bytes, direct)
        self.group.send_header(weights_header(specs, version=version, scope=scope, bucket_bytes=bucket_bytes,
                                              direct_bytes=direct))
        rejects = self.group.vote(False)
        if train_group:
            dist.broadcast(torch.tensor([int(rejects > 0)], dtype=torch.int32, device=self.group.device), src=0)
        if rejects:
            raise field_error(WeightSyncError, "weight_sync.version", version,
                              "every engine to accept the header", f"{rejects} engine(s) refused it; "
                              "their logs name the tensor (model config, LoRA targets or dtype differ)")
        total = 0
        with torch.no_grad():
            for b in buckets:
                buf = self._bucket(b, names, state, specs)
                self.group.broadcast(buf, f"bucket[{b.dtype}]")
                total += buf.numel() * buf.element_size()
                del buf
        failed = self.group.vote(False)  # every engine has copied (or loaded) the buckets
        if failed:
            raise field_error(WeightSyncError, "weight_sync.load", version, "every engine to load the version",
                              f"{failed} engine(s) failed to load it (their logs and errors name why); it is not "
                              "published to them")
        stats = SyncStats(version=version, num_tensors=len(specs), num_buckets=len(buckets), bytes=total,
                          seconds=time.perf_counter() - t0)
        log.info("weight sync v%d: %d tensors, %d buckets, %.1f MB in %.3f s", version, stats.num_tensors,
                 stats.num_buckets, total / 1e6, stats.seconds)
        return stats

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


def accept_header(group: _SyncGroup, check) -> tuple[dict, list[TensorSpec], float] | None:
    """A receiver's side of steps 1-2 of a sync: the header, ``check(header, specs)`` (raising
    ``WeightSyncError``), the vote. Returns (header, specs, the perf_counter after the header) or None when the
    sender closed the stream; a foreign or refused header votes "refuse" (the sender fails instead of hanging)."""
    try:
        header = group.recv_header()
    except WeightSyncTimeout:
        raise
    except WeightSyncError:
        group.vote(True)
        raise
    t0 = time.perf_counter()
    if header.get("kind") == "close":
        return None
    specs = specs_of_header(header)
    try:
        check(header, specs)
    except WeightSyncError:
        group.vote(True)
        raise
    if group.vote(False):
        raise field_error(WeightSyncError, "weight_sync.version", header["version"],
                          "every engine to accept the header", "another engine refused it (see its log)")
    return header, specs, t0


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
        self.group = _SyncGroup(cfg, rank, _sync_device(device))

    def receive(self) -> SyncStats | None:
        """Block for the next sync; copy it into the module in place. None when the sender closed."""
        def check(header: dict, specs: list[TensorSpec]) -> None:
            if header.get("scope") != self.scope:
                raise field_error(WeightSyncError, "weight_sync.scope", header.get("scope"), repr(self.scope),
                                  "sender and receiver must agree on full weights vs a LoRA adapter")
            check_specs(specs, self.targets)

        accepted = accept_header(self.group, check)
        if accepted is None:
            return None
        header, specs, t0 = accepted
        buckets = plan_buckets(specs, int(header["bucket_bytes"]), header.get("direct_bytes"))
        total = 0
        with torch.no_grad():
            for b in buckets:
                direct = _direct_view(self.targets[specs[b.entries[0][0]].name], b, self.group.device)
                buf = direct if direct is not None else torch.empty(b.numel, dtype=_DTYPES[b.dtype],
                                                                    device=self.group.device)
                self.group.broadcast(buf, f"bucket[{b.dtype}]")
                if direct is None:
                    for i, off, n in b.entries:
                        s = specs[i]
                        self.targets[s.name].copy_(buf[off:off + n].view(s.shape))
                total += buf.numel() * buf.element_size()
        if self.group.device.type == "cuda":
            torch.cuda.synchronize(self.group.device)
        self.group.vote(False)
        self.version = int(header["version"])
        return SyncStats(version=self.version, num_tensors=len(specs), num_buckets=len(buckets), bytes=total,
                         seconds=time.perf_counter() - t0)

    def close(self) -> None:
        if self.group.pg is not None:
            self.group.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
