"""The pool's vLLM engine actor: an ``EngineActor`` that starts and owns the run's vLLM server, which lives as
long as the actor (the run). Rollout as ``EngineActor.rollout`` (the dedicated-engine path of ``steps.sample_step``);
publish through the object store (staged full weights or a peft adapter) or as one more rank of the collective
publish group (``sync_ranks`` 2); a dead server raises ``EngineError`` and is replaced on the retried phase. How
each path works and what is refused: ``docs/execution.md`` ("vLLM engine actor").
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from unirl_core.checkpoint import CheckpointRef
from unirl_core.errors import EngineError
from unirl_core.runtime import build
from unirl_core.pool.actors import EngineActor, _device, _scope, _version
from unirl_core.weightsync.sync import WeightReceiver
from unirl_core.config.pool import Emit
from unirl_core.rollout.vllm.engine import beside
from unirl_core.rollout.weights import stage_state_dict
from unirl_core.types import SampleBatch


class VLLMEngineActor(EngineActor):
    """The rollout bundle (tokenizer, replay check) plus the vLLM server this actor started; ``served`` is the
    version the server is labelled with and the bundle holds."""

    def __init__(self, cfg, name: str, threads: int) -> None:
        super().__init__(cfg, name, threads)
        self._slot: build.EngineSlot | None = None
        self._watchdog = None
        self._start_s = 0.0  # seconds the last server start took, reported once by the call that started it

    # ------------------------------------------------------------------ the server
    def _engine(self, what: str) -> build.EngineSlot:
        """The process's engine slot, its server started on first use (or after it died)."""
        self._check_alive(what)
        t0 = time.perf_counter()
        try:
            slot = self.resources.dedicated_engine(self.cfg, self.policy)
        except EngineError as e:
            raise self._error(e, f"{what}: starting the vLLM server") from e
        if slot is not self._slot:
            self._slot, self._start_s = slot, time.perf_counter() - t0
            server = slot.engine.server
            self._watchdog = server.stop_with_parent() if server is not None else None
        return slot

    def _check_alive(self, what: str) -> None:
        """A server that exited since the last call: drop it (the next call starts a new one) and raise."""
        server = None if self._slot is None else self._slot.engine.server
        if server is not None and not server.alive():
            try:
                server.raise_if_dead()
            except EngineError as e:
                self._drop()
                raise self._error(e, what) from e

    def _drop(self) -> None:
        """Forget the engine (its server is dead or unusable): the bundle and server serve no version now, and
        the publish group (which had the old server's worker in it) is left."""
        self._slot, self.served = None, None
        EngineActor.close_sync(self)
        self.resources.close_engines()

    # ------------------------------------------------------------------ the publish group (collective)
    def sync_ranks(self) -> int:
        """The bundle's receiver and the server's worker."""
        return 2

    def join_sync(self, token: str, addr: str, port: int, rank: int, num_engines: int) -> None:
        """Join as ``rank`` (the bundle) and ``rank + 1`` (the server's worker, on a thread: both block until the
        group is complete)."""
        what = "opening the publish group"
        self.close_sync()
        slot = self._engine(what)
        p = self.cfg.pool
        module = self.policy.module

        def bundle() -> None:
            self._peer = WeightReceiver(self._sync_config(addr, port, num_engines), module, rank=rank,
                                        scope=_scope(self.cfg), device=_device(module))

        with self._leaving_group_on_error(what):
            beside(lambda: slot.engine.join_sync(master_addr=addr, master_port=port, rank=rank + 1,
                                                 num_engines=num_engines, timeout_s=p.sync_timeout_s,
                                                 bucket_mb=p.sync_bucket_mb), bundle, name="vllm-join-sync")
        self.sync_token = token

    @contextmanager
    def _leaving_group_on_error(self, what: str):
        """A failure inside leaves the publish group (the next publish opens a new one) and, when it is an
        ``EngineError``, is raised naming this actor."""
        try:
            yield
        except EngineError as e:
            self.close_sync()
            raise self._error(e, what) from e
        except BaseException:
            self.close_sync()
            raise

    def receive_weights(self, ckpt: CheckpointRef) -> dict[str, float]:
        """Version ``ckpt`` from the trainer's broadcast into the bundle and, at once, into the server."""
        what = f"publish v{ckpt.policy_version} (collective)"
        slot = self._engine(what)
        self.served = None
        with self._leaving_group_on_error(what):
            out = slot.engine.receive_sync(ckpt.policy_version, timeout_s=self.cfg.pool.sync_timeout_s,
                                           alongside=lambda: EngineActor.receive_weights(self, ckpt))
        slot.served_uri = ckpt.uri
        self.served = _version(ckpt)
        return out

    def close_sync(self) -> None:
        """Leave the publish group: the bundle's receiver, and the server's worker when the server runs."""
        joined = self.sync_token is not None or getattr(self, "_peer", None) is not None
        super().close_sync()
        slot = self._slot
        if joined and slot is not None and slot.engine.server is not None and slot.engine.server.alive():
            slot.engine.close_sync()

    def _error(self, error: EngineError, what: str) -> EngineError:
        """``error`` of ``what`` naming this actor. A server that exited, or no longer answers its health check
        (a SIGKILLed server's process can take seconds to exit: its threads still hold the port), is dropped."""
        slot = self._slot
        dead = slot is None or slot.engine.server is None or not slot.engine.server.alive() or \
            not slot.engine.client.is_healthy("/health")
        if dead and slot is not None:
            self._drop()  # stops what is left of its process group
        note = "the next call starts a new server (retry the phase)" if dead else "the server is still up"
        return EngineError(f"pool actor {self.name!r} of run {self.cfg.name!r}: {what} failed ({note}): {error}")

    def server_info(self) -> dict[str, float]:
        """The server's pid (its process group), the version label it reports now (``GET /weight_info``) and how its
        last version arrived (``last_sync_delta`` 1.0: as a delta; ``last_sync_bytes``: what was read for it)."""
        slot = self._engine("server_info")
        sync = slot.engine.last_sync or {}
        return {"pid": float(slot.engine.server.pid), "served_version": float(slot.engine.served_version()),
                "last_sync_delta": float(sync.get("kind") == "delta"), "last_sync_bytes": float(sync.get("bytes", 0))}

    def shutdown(self) -> None:
        """Stop the server (the pool calls this before it kills the actor)."""
        self._drop()

    # ------------------------------------------------------------------ EngineActor
    def served_version(self):
        """The version the bundle holds, when the server's own label (``/weight_info``) agrees; else None."""
        if self.served is None or self._slot is None or not self._slot.engine.server.alive():
            return None
        try:
            label = self._slot.engine.served_version()
        except EngineError:
            return None
        return self.served if label == self.served[1] else None

    def apply_delta(self, ckpt: CheckpointRef) -> dict[str, float] | None:
        """A delta version (``checkpoint.weights_encoding: delta``) into the bundle (``EngineActor.apply_delta``)
        and the server: the engine is handed the store's ref, so each worker XORs the version's delta file into
        the host copy it kept of the base and checks the result against the version's digest; a server not at the
        delta's base (its first version from the store, a replaced server) reloads the version in full from the
        store and keeps it as the next base (``vllm/engine.py``, ``vllm/worker_ext.py``). None (the caller
        publishes ``ckpt`` in full) when the bundle is not at the base, or for a server fed adapters
        (``weight_sync: lora``: an adapter is swapped whole)."""
        what = f"publish v{ckpt.policy_version} (delta)"
        slot = self._engine(what)
        if slot.engine.config.weight_sync == "lora":
            return None
        out = super().apply_delta(ckpt)
        if out is None:
            return None
        self.served = None  # the bundle holds ckpt; the server does once it reloaded
        self._serve(slot, ckpt, ckpt, what)
        sync = slot.engine.last_sync
        return {**out, "server_delta": float(sync["kind"] == "delta"), "server_bytes": float(sync["bytes"])}

    def load_weights(self, weights: dict, ckpt: CheckpointRef) -> float:
        """In-pool publication of version ``ckpt`` (the trainer's state dict): into the bundle, then staged and
        reloaded by the server, labelled ``ckpt.policy_version``. Returns the seconds it took."""
        t0 = time.perf_counter()
        what = f"publish v{ckpt.policy_version}"
        self.served = None
        build.apply_policy_weights(self.policy, weights, where=f"{self.name} <- trainer ({ckpt.uri})")
        slot = self._engine(what)
        engine_cfg = slot.engine.config
        if engine_cfg.weight_sync == "lora":  # the adapter from the bundle (the trainer's dict may carry a tied head)
            source = slot.publish_source(self.cfg, self.policy, ckpt)
        elif build.store(self.cfg).encoding.deltas:  # written before publish: from the store's ref, so the workers
            slot.engine.expect_deltas()              # keep it as the base the next version's delta applies to
            source = ckpt
        else:  # the trainer's fp32 values, exactly what the store's version holds
            source = stage_state_dict(weights, want="full", staging=slot.staging, policy_version=ckpt.policy_version,
                                      base_model=str(engine_cfg.model), where=f"{ckpt.uri} (the trainer's copy)")
        self._serve(slot, source, ckpt, what)
        return time.perf_counter() - t0

    def _serve(self, slot: build.EngineSlot, source: object, ckpt: CheckpointRef, what: str) -> None:
        """The server reloads ``source`` (a staged folder, an adapter or the store's ref) as version ``ckpt``."""
        try:
            slot.engine.update_weights(source, ckpt.policy_version)
        except EngineError as e:
            raise self._error(e, what) from e
        slot.served_uri = ckpt.uri
        slot.prune_staging()
        self.served = _version(ckpt)

    def rollout(self, ckpt: CheckpointRef, step: int, shard: int, num_shards: int,
                emit: Emit) -> tuple[SampleBatch, dict[str, float]]:
        what = f"rollout step {step} shard {shard}"
        self._engine(what)  # started (and timed) before the rollout's clock runs
        try:
            out, metrics = super().rollout(ckpt, step, shard, num_shards, emit)
        except EngineError as e:
            raise self._error(e, what) from e
        metrics["pool/vllm_server_start_s"], self._start_s = self._start_s, 0.0
        return out, metrics
