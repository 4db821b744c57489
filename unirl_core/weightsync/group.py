"""The weight-sync process group: where sender and receivers meet (``WeightSyncConfig``) and the collectives
they run on a process group of their own (``SyncGroup``: broadcasts, votes, the JSON header), with a dead or
silent peer surfacing as ``WeightSyncTimeout`` / ``WeightSyncError`` naming the step. What travels over it and in
which order: ``sync.py`` (this package's ``WeightSender`` / ``WeightReceiver``) and ``stream.py``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from unirl_core.errors import ConfigError, check_ints, field_error
from unirl_core.weightsync.wire import WeightSyncError, WeightSyncTimeout, decode_header, encode_header

log = logging.getLogger("unirl_core.weightsync.sync")  # one logger for the sync's messages, as before the split

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


class SyncGroup:
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
        """Sum over ranks of ``reject`` (how many ranks refuse)."""
        return self.votes(reject)[0]

    def votes(self, *flags: bool) -> list[int]:
        """Sum over ranks of each flag, in one all-reduce."""
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._wait(self.pg.allreduce([t], opts), "vote")
        return [int(x) for x in t.tolist()]

    def send_header(self, header: dict) -> int:
        """Broadcast ``header``; returns the bytes that travelled (its length and its JSON)."""
        payload = encode_header(header).to(self.device)
        self.broadcast(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device), "header_len")
        self.broadcast(payload, "header")
        return 8 + payload.numel()

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


def sync_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
