"""The receiving end of the trainer -> engine broadcast for a model that loads weights itself.

``WeightReceiver`` (``sync.py``) copies each bucket into a module of ours in place, by name. A vLLM
worker's model is not one of ours: its parameters are fused (``qkv_proj``), cast and post-processed (on CPU a
prepacked GEMM), and only its own loader (``model.load_weights`` / the worker's in-place ``reload_weights``) maps
checkpoint-named tensors onto them. ``StreamReceiver`` joins the same sync group, speaks the same protocol
(header, vote, per-dtype buckets, final vote) and hands each sync's tensors to a consumer as a stream of
``(checkpoint name, tensor)`` pairs, bucket by bucket, so the loader runs while the buckets arrive.

Checks, before any bucket travels: the names and shapes sent are exactly those of the served checkpoint (plus
the tied LM head a trainer's module also names). A delta offered by the sender (``WeightSender(deltas=True)``) is
declined: this receiver votes that it lacks the base, so the full weights travel. A consumer that fails (or stops
early) still receives the remaining buckets, so the sender is never left hanging, and votes "failed" at the end: the sender raises
``WeightSyncError`` instead of treating the version as published.

Imports torch and this package's light modules only: it runs inside vLLM's own interpreter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, field_error
from unirl_core.weightsync.group import SyncGroup, sync_device
from unirl_core.weightsync.sync import (
    _DTYPES,
    SyncStats,
    TensorSpec,
    WeightSyncConfig,
    WeightSyncError,
    accept_header,
    check_names,
    plan_buckets,
)

Consumer = Callable[[Iterator[tuple[str, Tensor]]], object]


def check_names_and_shapes(specs: list[TensorSpec], expected: Mapping[str, tuple[int, ...]],
                           optional: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Raise ``WeightSyncError`` naming the first tensor the served model does not have, lacks or shapes
    differently; ``optional`` names may be sent or not (a tied LM head)."""
    optional = dict(optional or {})
    check_names(specs, {**expected, **optional}, expected,
                unknown=("names of the served checkpoint", "trainer and server must load the same architecture"),
                missing=("a tensor for every checkpoint entry", "publish the full weights (train.weights_scope "
                         "full or a full fine-tune's trainable parameters) to a server"))
    for s in specs:
        want = expected.get(s.name, optional.get(s.name))
        if tuple(want) != s.shape:
            raise field_error(WeightSyncError, f"weight_sync.tensors[{s.name!r}].shape", s.shape,
                              f"{tuple(want)} (served checkpoint)", "trainer and server model configs differ")


class StreamReceiver:
    """Joins the sync group as ``rank`` (1..num_engines); each ``receive`` streams one sync to a consumer."""

    def __init__(self, cfg: WeightSyncConfig, *, expected: Mapping[str, tuple[int, ...]],
                 optional: Mapping[str, tuple[int, ...]] | None = None, rank: int = 1,
                 device: str | torch.device = "cpu") -> None:
        if not (isinstance(rank, int) and 1 <= rank <= cfg.num_engines):
            raise field_error(ConfigError, "weight_sync.rank", rank, f"an engine rank in 1..{cfg.num_engines}",
                              "rank 0 is the trainer's sender")
        if not expected:
            raise field_error(ConfigError, "weight_sync.expected", {}, "the served checkpoint's tensor names",
                              "read them from the model folder the server started from")
        self.cfg = cfg
        self.expected = {k: tuple(v) for k, v in expected.items()}
        self.optional = {k: tuple(v) for k, v in (optional or {}).items()}
        self.version: int | None = None
        self.group = SyncGroup(cfg, rank, sync_device(device))

    def receive(self, consume: Consumer) -> SyncStats | None:
        """Block for the next sync and feed its tensors to ``consume`` (called once with an iterator of
        ``(name, tensor)``; the tensors are views of freshly received buckets, never reused). None when the
        sender closed the stream."""
        accepted = accept_header(self.group, lambda _h, specs: check_names_and_shapes(specs, self.expected,
                                                                                    self.optional))
        if accepted is None:
            return None
        header, specs, t0, _ = accepted  # never a delta: the server's loader takes whole tensors (votes "lacks base")
        buckets = plan_buckets(specs, int(header["bucket_bytes"]), header.get("direct_bytes"))
        received = {"bytes": 0}
        group_failed: list[BaseException] = []

        def stream() -> Iterator[tuple[str, Tensor]]:
            for b in buckets:
                buf = torch.empty(b.numel, dtype=_DTYPES[b.dtype], device=self.group.device)
                try:
                    self.group.broadcast(buf, f"bucket[{b.dtype}]")
                except BaseException as e:  # the group is broken: nothing more can be received or voted
                    group_failed.append(e)
                    raise
                received["bytes"] += buf.numel() * buf.element_size()
                for i, off, n in b.entries:
                    yield specs[i].name, buf[off:off + n].view(specs[i].shape)

        tensors = stream()
        failure: BaseException | None = None
        try:
            consume(tensors)
        except Exception as e:  # noqa: BLE001 - the loader's own error, reported through the final vote
            failure = e
        if group_failed:
            raise group_failed[0]
        for _ in tensors:  # the sender broadcasts every bucket: take the ones the consumer left
            pass
        if group_failed:
            raise group_failed[0]
        if self.group.device.type == "cuda":
            torch.cuda.synchronize(self.group.device)
        self.group.vote(failure is not None)
        if failure is not None:
            raise field_error(WeightSyncError, "weight_sync.load", type(failure).__name__,
                              f"the server to load version {header['version']}", str(failure)) from failure
        self.version = int(header["version"])
        return SyncStats(version=self.version, num_tensors=len(specs), num_buckets=len(buckets),
                         bytes=received["bytes"], seconds=time.perf_counter() - t0)

    def close(self) -> None:
        if self.group.pg is not None:
            self.group.close()
