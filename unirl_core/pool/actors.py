"""The pool's actors as plain classes; ``unirl_core.pool.cluster`` wraps them with ``ray.remote``.

Each runs in its own Ray worker process and keeps its state between calls: the engine its rollout bundle
(and the full batches it sampled, in the object store), the trainer its TrainBackend with the optimizer
state, the reward actor its scorers. Every method takes and returns the library's own types.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import torch

from unirl_core.checkpoint import CheckpointRef, restore_train_checkpoint
from unirl_core.checkpoint.sharded import (
    latest_state,
    load_sharded_state,
    prune_states,
    save_sharded_state,
)
from unirl_core.checkpoint.store import (
    EXTRA,
    TRAIN_STATE,
    load_manifest,
    load_version_json,
)
from unirl_core.checkpoint.writer import VersionWriter
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, ConfigError, RewardError, field_error
from unirl_core.runtime import build, steps
from unirl_core.runtime.resources import Resources
from unirl_core.pool import transport
from unirl_core.config.pool import Emit
from unirl_core.pool.projection import for_training, project
from unirl_core.weightsync.sync import (
    SyncScope,
    WeightReceiver,
    WeightSender,
    WeightSyncConfig,
    WeightSyncError,
    follow_send,
    sync_names,
    sync_sources,
)
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

QUERY_GROUP = "query"
"""Ray concurrency group (one thread) of the methods in ``QUERIES``: they answer while the actor's default group
runs a rollout, a train step or a publish (lagged rollouts: the trainer fetches step n's batch from an engine that
is sampling step n + 1). They only read or drop bookkeeping, never the module."""
QUERIES = frozenset({"pid", "placement", "current_sync", "current_group", "served_version", "batch_ref", "release"})

Version = tuple[str, int]
"""(checkpoint URI, policy version): the identity of a set of weights inside the pool."""


def _version(ckpt: CheckpointRef) -> Version:
    return ckpt.uri, ckpt.policy_version


def run_setup_hook(hook: str | None) -> None:
    """Import ``module:function`` (``pool.worker_setup_hook``) and call it; a failure names the field."""
    if hook is None:
        return
    import importlib

    module, _, func = hook.partition(":")
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise field_error(ConfigError, "pool.worker_setup_hook", hook, "a function importable in the actor "
                          "process", f"install its module in the image or put it on PYTHONPATH ({exc})") from exc
    fn()


class _Actor:
    def __init__(self, cfg: RunConfig, name: str, threads: int) -> None:
        # Ray sets OMP_NUM_THREADS from num_cpus only when unset; set torch's pool explicitly so a CPU actor
        # computes with the thread count it reserved (thread counts can change a reduction's bits).
        torch.set_num_threads(threads)
        self.cfg, self.name = cfg, name
        self.resources = Resources()  # this actor's bundles, trainer and dedicated engine
        transport.register()  # batches this actor returns or puts travel as Arrow IPC
        run_setup_hook(cfg.pool.worker_setup_hook)

    def pid(self) -> int:
        """The worker process id (tests kill it to simulate a lost node)."""
        return os.getpid()

    def placement(self) -> tuple[str, tuple[str, ...]]:
        """(node id, GPU ids) of this actor: two actors on one GPU cannot share an NCCL group."""
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", []))

    # the publish group (trainer = rank 0, engine i = rank i + 1), identified by a token the driver draws
    sync_token: str | None = None

    def current_sync(self) -> str | None:
        return self.sync_token

    def close_sync(self) -> None:
        peer, self._peer, self.sync_token = getattr(self, "_peer", None), None, None
        if peer is not None and peer.group.pg is not None:
            # leave the group without the sender's "close" header: a member may be dead, and a broadcast
            # to it would block until sync_timeout_s
            peer.group.close()

    def _sync_config(self, addr: str, port: int, num_engines: int) -> WeightSyncConfig:
        p = self.cfg.pool
        return WeightSyncConfig(master_addr=addr, master_port=port, num_engines=num_engines,
                                bucket_mb=p.sync_bucket_mb, timeout_s=p.sync_timeout_s)


def _scope(cfg: RunConfig) -> SyncScope:
    """The wire scope of a publish: what a version's ``model.safetensors`` holds, by module name."""
    return "full" if cfg.train.weights_scope == "full" else "trainable"


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def policy_modules(policy) -> dict[str, torch.nn.Module]:
    """The torch modules a bundle holds, by name: its trainable ``module`` and, for a diffusion pipeline, the other
    components (VAE, text encoders). A LoRA bundle's KL reference is its module with the adapter off (no copy)."""
    out = {"module": policy.module}
    components = getattr(getattr(policy, "pipeline", None), "components", None) or {}
    for name, comp in components.items():
        if isinstance(comp, torch.nn.Module) and comp is not policy.module:
            out[name] = comp
    return out


class EngineActor(_Actor):
    """The rollout bundle and the trainside engine; holds one set of weights, labelled by version."""

    def __init__(self, cfg: RunConfig, name: str, threads: int) -> None:
        super().__init__(cfg, name, threads)
        self.policy = self.resources.bundle(cfg)
        self.served: Version | None = None
        self._batches: dict[tuple[int, int], object] = {}  # (step, shard) -> ObjectRef of the full batch
        self._batches_lock = threading.Lock()  # rollout (default group) and batch_ref / release (query group)

    def served_version(self) -> Version | None:
        return self.served

    def frozen_modules(self) -> dict[str, torch.nn.Module]:
        """The modules whose frozen tensors a named pool's host shares between tenants (``pool/frozen.py``)."""
        return policy_modules(self.policy)

    def load_weights(self, weights: dict[str, torch.Tensor], ckpt: CheckpointRef) -> float:
        """In-pool publication: the trainer's trainable (or full) state dict of version ``ckpt``; returns the
        seconds it took. Rounded into the bundle's dtype on copy, exactly as a load from the store."""
        t0 = time.perf_counter()
        build.apply_policy_weights(self.policy, weights, where=f"{self.name} <- trainer ({ckpt.uri})")
        self.served = _version(ckpt)
        return time.perf_counter() - t0

    def apply_delta(self, ckpt: CheckpointRef) -> dict[str, float] | None:
        """In-pool publication of a delta version (``checkpoint.weights_encoding: delta``) complete in the store:
        when this engine serves the delta's base, the delta file alone XOR-ed into the bundle's module and checked
        against the version's digest (``build.apply_version_delta``). None when it does not apply (a full version,
        another base, other dtypes, a digest mismatch): the engine then holds no version until the caller publishes
        ``ckpt`` in full (or its next rollout loads it from the store)."""
        t0 = time.perf_counter()
        served, self.served = self.served, None  # from the first XOR on the module holds no version until checked
        module = self.policy.module
        held = None
        if served is not None and build.held_weights(module) is None:  # received in-pool: its digest from the store
            held = build.version_digest(CheckpointRef(uri=served[0], run=ckpt.run, step=0, policy_version=served[1]),
                                        self.cfg)
        try:
            applied = build.apply_version_delta(self.policy, ckpt, self.cfg, held=held)
        except CheckpointError as e:
            log.warning("%s: delta of %s not applied (%s); publishing it in full", self.name, ckpt.uri, e)
            applied = False
        if not applied:
            return None
        self.served = _version(ckpt)
        return {"seconds": time.perf_counter() - t0}

    def sync_dtypes(self) -> dict[str, str]:
        """Wire name -> dtype of the tensors a publish writes into (the trainer casts its fp32 masters to these
        on its device, rounding exactly as a load from the store does)."""
        targets = sync_names(self.policy.module, _scope(self.cfg))
        return {n: str(t.dtype).removeprefix("torch.") for n, t in targets.items()}

    def sync_ranks(self) -> int:
        """Ranks this actor takes in the publish group (its bundle's receiver)."""
        return 1

    def join_sync(self, token: str, addr: str, port: int, rank: int, num_engines: int) -> None:
        """Join the publish group as ``rank``; blocks until the trainer and every engine have joined."""
        self.close_sync()
        module = self.policy.module
        self._peer = WeightReceiver(self._sync_config(addr, port, num_engines), module, rank=rank,
                                    scope=_scope(self.cfg), device=_device(module))
        self.sync_token = token

    def receive_weights(self, ckpt: CheckpointRef) -> dict[str, float]:
        """Receive version ``ckpt`` from the trainer's broadcast, in place into the bundle's module: a delta on the
        version the receiver took last, when the module still holds exactly that one."""
        if self.served is None or self.served != getattr(self, "_received", None):
            self._peer.forget()  # loaded from the store (or the object store) since: not the receiver's base
        self.served = self._received = None  # from the first bucket on the module holds no version until checked
        build.forget_held_weights(self.policy.module)
        try:
            stats = self._peer.receive()
        except Exception:
            self.close_sync()
            raise
        if stats is None or stats.version != ckpt.policy_version:
            self.close_sync()
            raise field_error(WeightSyncError, f"{self.name}: publish of {ckpt.uri}", None if stats is None
                              else stats.version, f"policy version {ckpt.policy_version}",
                              "the trainer broadcast another version; the engine loads it from the store")
        self.served = self._received = _version(ckpt)
        return {"seconds": stats.seconds, "bytes": float(stats.bytes), "version": float(stats.version),
                "delta": float(stats.delta)}

    def rollout(self, ckpt: CheckpointRef, step: int, shard: int, num_shards: int,
                emit: Emit) -> tuple[SampleBatch, dict[str, float]]:
        """Sample one shard with ``ckpt``'s weights (from the store when the pool has not published them here,
        e.g. after a restart); keeps the full batch in the object store for the trainer."""
        import ray

        t0 = time.perf_counter()
        from_store = self.served != _version(ckpt)
        if from_store:
            self.served = None
            build.load_policy_weights(self.policy, ckpt, self.cfg)
            self.served = _version(ckpt)
        batch, metrics = steps.sample_step(self.cfg, self.policy, ckpt, step=step, shard=shard,
                                            num_shards=num_shards, weights="policy", started=t0,
                                            resources=self.resources)
        ref = ray.put(batch)  # owned by this actor: lives as long as it holds it
        # a lagged rollout of step n runs while step n - lag still waits for its train call: keep those
        keep_from = step - self.cfg.async_training.max_policy_lag
        with self._batches_lock:
            self._batches = {k: v for k, v in self._batches.items() if k[0] >= keep_from}
            self._batches[(step, shard)] = ref
        metrics["pool/weights_from_store"] = float(from_store)
        return (batch if emit == "full" else project(batch)), metrics

    def batch_ref(self, step: int, shard: int) -> list | None:
        """``[ObjectRef]`` of the full batch of (step, shard), or None when this engine does not hold it."""
        with self._batches_lock:
            ref = self._batches.get((step, shard))
        return None if ref is None else [ref]

    def release(self, step: int) -> None:
        """Drop the full batches of steps up to ``step`` (the trainer has consumed them)."""
        with self._batches_lock:
            self._batches = {k: v for k, v in self._batches.items() if k[0] > step}


class TrainerActor(_Actor):
    """The TrainBackend with its optimizer state resident; restores from the store only when its state is not
    the version it is asked to train from (first call, a restarted actor, a retried step)."""

    def __init__(self, cfg: RunConfig, name: str, threads: int) -> None:
        super().__init__(cfg, name, threads)
        self.rank, self.group_token = 0, None
        # a rank of a group builds its backend once the group is open (join_group): FSDP2 shards over it
        self.backend = self.resources.trainer(cfg) if cfg.pool.trainer_ranks == 1 else None
        self.state: Version | None = None  # the version the resident state equals, None before a restore
        self.extra: dict[str, object] = {}
        self._writer = VersionWriter()  # train_background: the version written on a thread, as run_local does

    def frozen_modules(self) -> dict[str, torch.nn.Module]:
        """The modules whose frozen tensors a named pool's host shares between tenants (``pool/frozen.py``): the
        backend's bundle (none before a trainer group built it; a named pool has one rank)."""
        return {} if self.backend is None else policy_modules(self.backend.policy)

    def current_group(self) -> str | None:
        """The token of the trainer group this rank joined (None before ``join_group``)."""
        return self.group_token

    def group_endpoint(self) -> tuple[str, int]:
        """(address, free port) where rank 0 will host the trainer group's rendezvous store."""
        return _free_endpoint()

    def join_group(self, token: str, addr: str, port: int, rank: int, world: int) -> None:
        """Join the trainer group as ``rank`` of ``world`` (the default torch.distributed group of this process:
        NCCL when the model is on a GPU, gloo on CPU; rendezvous on rank 0's store under ``token``), then build
        the TrainBackend, which shards the policy with FSDP2 over it. Blocks until every rank has joined."""
        from datetime import timedelta

        import torch.distributed as dist

        if dist.is_initialized():
            raise field_error(ConfigError, "pool.trainer_ranks", world, "a fresh actor per rank",
                              f"{self.name} already joined a trainer group; the driver re-creates the group")
        policy = build.train_bundle(self.cfg)
        device = _device(policy.module)
        timeout = timedelta(seconds=self.cfg.pool.sync_timeout_s)
        store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                store=dist.PrefixStore(f"unirl-trainer-{token}", store), timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        from unirl_core.train.backend import TrainBackend

        self.backend = TrainBackend(policy, build.algorithm(self.cfg), self.cfg.train)
        self.rank, self.group_token = rank, token

    def train(self, ckpt: CheckpointRef, step: int, scored: SampleBatch,
              *shards: SampleBatch) -> tuple[CheckpointRef, dict[str, float]]:
        """Train the full ``shards`` of step ``step`` with ``scored``'s advantages; writes (unpublished)
        version ``step`` to the store, as the pods train phase does."""
        return self._train(ckpt, step, scored, shards, background=False)

    def train_background(self, ckpt: CheckpointRef, step: int, scored: SampleBatch,
                         *shards: SampleBatch) -> tuple[CheckpointRef, dict[str, float]]:
        """``train``, with version ``step`` written on this actor's writer thread from a snapshot (one rank only):
        the ref returns before the version exists, as ``run_local``'s in-process train phase does. The next
        ``train*`` call (and a restore) waits for the write first and raises its failure; ``publish_version`` has
        the thread move ``LATEST`` once it is written; ``wait_version`` waits for it. The pool's executor asks for it
        with one trainer rank only (each rank's write is collective)."""
        return self._train(ckpt, step, scored, shards, background=True)

    def publish_version(self, ckpt: CheckpointRef) -> bool:
        """Have the writer thread publish ``ckpt`` (move ``LATEST``, retention) once its files are written; False
        when ``ckpt`` is not this actor's background write (the caller publishes it from the store)."""
        return self._writer.publish(ckpt)

    def prune_versions(self) -> None:
        """Apply the store's retention (``checkpoint.keep_last`` / ``keep_every``) on the writer's thread, after
        the writes queued so far: deleting a GB-sized version stays off the next step's path. Best effort (a
        failure is logged; the next publish's retention deletes what this one left)."""
        self._writer.later(build.store(self.cfg).apply_retention, f"{self.name}: retention of run {self.cfg.name!r}")

    def wait_version(self) -> None:
        """Wait for the background version write (and its publish), then for a retention queued behind it
        (``prune_versions``); raises the write's failure (``CheckpointError``)."""
        self._writer.wait()
        self._writer.wait_chores()

    def shutdown(self) -> None:
        """Before the pool kills this actor: finish the background version write and the sharded state write, so
        a version already handed out is complete (or, failed, never published)."""
        self._finish_writes(log.error)

    def _finish_writes(self, report) -> None:
        """Wait for the background version write, then the sharded state write; a failed one is ``report``ed
        (that version / state is not in the store), not raised."""
        for wait in (self._writer.wait, self.wait_state, self._writer.wait_chores):
            try:
                wait()
            except CheckpointError as e:
                report("%s: %s", self.name, e)

    def _train(self, ckpt: CheckpointRef, step: int, scored: SampleBatch, shards: tuple[SampleBatch, ...], *,
               background: bool) -> tuple[CheckpointRef, dict[str, float]]:
        cfg, ck, restored = self.cfg, self.cfg.checkpoint, False

        def hold() -> dict:
            nonlocal restored
            restored = self._hold(ckpt)
            self.state = None  # from here on the resident state is no version until it is saved
            return self.extra

        full_now = ck.full_state_at(step, cfg.loop.total_steps)
        # one rank writes through its writer even when the caller waits for the version (``train``): the weights
        # go through the writer's reused pinned buffers, not a fresh pageable copy (~1 s of 1.2 GB on an H200)
        ref, extra, out = steps.train_and_save(
            cfg, self.backend, for_training(SampleBatch.concat(list(shards)), scored), ckpt, hold=hold,
            wait=self._writer.wait, writer=self._writer if background or cfg.pool.trainer_ranks == 1 else None,
            background=background, full_state=full_now and ck.full_state == "file", memory=self._writer.memory)
        t0 = time.perf_counter()  # the sharded full state's start (last step: its whole write)
        if full_now and ck.full_state == "sharded":
            self._write_sharded(last=step >= cfg.loop.total_steps)
        self.state, self.extra = _version(ref), extra
        out["checkpoint/full_state_start_s"] = time.perf_counter() - t0
        out["pool/trainer_restored"] = float(restored)
        return ref, out

    def _hold(self, ckpt: CheckpointRef) -> bool:
        """Make the resident state version ``ckpt`` (restoring it when it is another); True when restored."""
        if self.state == _version(ckpt) and self.backend.step_count == ckpt.step:
            return False
        self.state = None
        self.extra = self._restore(ckpt)
        self.state = _version(ckpt)
        return True

    def _write_sharded(self, *, last: bool) -> None:
        """Start the sharded state write of the step just trained; the previous one must be complete first
        (at most one in flight). The last step's write is waited for: the run ends with a complete state."""
        cfg = self.cfg
        self.wait_state()
        self._pending = save_sharded_state(cfg.checkpoint.root, cfg.name, self.backend, asynchronous=not last,
                                           storage_options=cfg.checkpoint.storage_options)
        if last:
            self.wait_state()

    def wait_state(self) -> int | None:
        """Finish the sharded state write in flight, if any; returns its step."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is None:
            return None
        step = pending.wait().step
        ck = self.cfg.checkpoint
        prune_states(ck.root, self.cfg.name, keep_last=ck.keep_last, keep_every=ck.keep_every,
                     storage_options=ck.storage_options)
        return step

    def _restore(self, ckpt: CheckpointRef) -> dict[str, object]:
        """Load version ``ckpt``'s full state: its ``train_state.pt``, else the sharded ``state-<step>/`` of
        the same step. Returns the version's extra JSON state."""
        cfg = self.cfg
        opts = cfg.checkpoint.storage_options
        self._finish_writes(log.warning)  # a failed write: that version / state is not there; decided below
        if TRAIN_STATE in load_manifest(ckpt, storage_options=opts).files:
            return dict(restore_train_checkpoint(self.backend, ckpt, storage_options=opts).extra)
        state = latest_state(cfg.checkpoint.root, cfg.name, at_most=ckpt.step, storage_options=opts)
        if state is None or state.step != ckpt.step:
            have = "none" if state is None else f"step {state.step}"
            raise field_error(CheckpointError, "checkpoint.every_n_steps", cfg.checkpoint.every_n_steps,
                              f"a full resumable state of step {ckpt.step} (the version the trainer resumes "
                              f"from); the newest complete one at or before it: {have}",
                              "fork the run from the version of that step (fork_as=..., resume_from=<its "
                              "step folder>) to retrain the steps since; a smaller every_n_steps loses fewer")
        load_sharded_state(self.backend, state, storage_options=opts)
        return dict(load_version_json(ckpt, EXTRA, storage_options=opts) or {})

    def holds(self, ckpt: CheckpointRef) -> bool:
        """True when the resident weights are exactly version ``ckpt`` (the trainer can publish it)."""
        return self.state == _version(ckpt)

    def sync_endpoint(self) -> tuple[str, int]:
        """(address, free port) where this trainer will host the publish group's rendezvous store."""
        return _free_endpoint()

    def open_sync(self, token: str, addr: str, port: int, num_engines: int, dtypes: dict[str, str],
                  wire_deltas: bool = True) -> None:
        """Host the publish group as rank 0; blocks until every engine has joined. ``dtypes``: the engines'
        tensor dtypes (``EngineActor.sync_dtypes``), the casts of every later broadcast. The other trainer ranks
        are not in the publish group: they keep the casts and bucket plan to follow rank 0's gathers.
        ``wire_deltas`` False: an engine of the group cannot take a delta on the wire (a vLLM server's worker),
        so the sender keeps no copy of the last version and sends full weights."""
        self.close_sync()
        module = self.backend.policy.module
        sync = self._sync_config(addr, port, num_engines)
        # delta versions (checkpoint.weights_encoding): the publish sends deltas too, against the previous publish
        deltas = wire_deltas and build.store(self.cfg).encoding.deltas
        if self.rank == 0:
            self._peer = WeightSender(sync, device=_device(module), deltas=deltas)
        self._plan = {"bucket_bytes": sync.bucket_bytes, "direct_bytes": sync.direct_bytes, "deltas": deltas}
        self._cast = {n: getattr(torch, d) for n, d in dtypes.items()}
        self.sync_token = token

    def broadcast_weights(self, ckpt: CheckpointRef) -> dict[str, float]:
        """Broadcast the resident weights, version ``ckpt``, to the publish group: straight from the module's
        tensors on its device (a sharded module is gathered one bucket at a time), cast to the engines' dtypes."""
        if self.state != _version(ckpt):
            raise field_error(WeightSyncError, f"{self.name}: publish", ckpt.uri, f"the resident version "
                              f"{self.state}", "publish the version the trainer holds; engines load others "
                              "from the store")
        module = self.backend.policy.module
        sources = sync_sources(module, _scope(self.cfg))
        if self.rank > 0:  # takes part in rank 0's gathers of each sharded tensor, in its order
            verdict = torch.zeros(1, dtype=torch.int32, device=self.backend.dist.device)
            follow_send(sources, cast=self._cast, verdict=verdict, **self._plan)
            return {"seconds": 0.0, "bytes": 0.0, "header_bytes": 0.0, "buckets": 0.0, "delta": 0.0,
                    "resent_full": 0.0}
        try:
            stats = self._peer.send(sources, ckpt.policy_version, scope=_scope(self.cfg), cast=self._cast,
                                    train_group=self.backend.world_size > 1)
        except Exception:
            self.close_sync()
            raise
        return {"seconds": stats.seconds, "bytes": float(stats.bytes), "header_bytes": float(stats.header_bytes),
                "buckets": float(stats.num_buckets), "delta": float(stats.delta),
                "resent_full": float(stats.resent_full is not None)}

    def weights(self, ckpt: CheckpointRef) -> list:
        """``[ObjectRef]`` of the state dict of version ``ckpt`` (``model_state_dict``), or ``[]`` when the
        resident state is another version (then engines load ``ckpt`` from the store)."""
        import ray

        if self.state != _version(ckpt):
            return []
        state = self.backend.model_state_dict()  # collective under FSDP2: the tensors reach rank 0 only
        return [ray.put(state)] if self.rank == 0 else []


def _free_endpoint() -> tuple[str, int]:
    """(this node's address, a port free on it) for a rendezvous store this actor hosts."""
    import ray

    addr = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((addr, 0))
        return addr, s.getsockname()[1]


class RewardActor(_Actor):
    """The RewardService (scorers loaded once)."""

    def __init__(self, cfg: RunConfig, name: str, threads: int) -> None:
        super().__init__(cfg, name, threads)
        self.service = build.reward_service(cfg)

    def frozen_modules(self) -> dict[str, torch.nn.Module]:
        """None to share: ``build.reward_service`` keeps one service per reward config in the process, so tenants
        of one reward config already score with one set of scorer models (built on first use, after attach)."""
        return {}

    def score(self, batch: SampleBatch) -> tuple[list[Scores], dict[str, float]]:
        """Score ``batch``; only what scoring wrote travels back (``apply_scores`` puts it on the caller's copy),
        not the batch: its media would make a second trip for nothing."""
        scored, stats = self.service.score_with_stats(batch)
        return scores_of(scored), stats.as_metrics()


# what RewardActor.score returns per generated part: sample id, per-component rewards, total reward, valid
Scores = tuple[str, dict[str, float], float | None, bool]


def scores_of(batch: SampleBatch) -> list[Scores]:
    """What scoring wrote on each generated part of ``batch``."""
    return [(p.sample_id, dict(p.rewards), p.reward, p.valid) for p in batch.generated]


def apply_scores(batch: SampleBatch, scores: list[Scores]) -> SampleBatch:
    """Write the reward actor's ``scores`` onto ``batch`` (the batch it scored), in place, as the in-process
    RewardService does; returns ``batch``."""
    parts = batch.generated
    ids = [p.sample_id for p in parts]
    if [s[0] for s in scores] != ids:
        raise RewardError(f"the reward actor scored samples {[s[0] for s in scores][:3]}... ({len(scores)}) but the "
                          f"batch holds {ids[:3]}... ({len(ids)}): the scores belong to another batch")
    for part, (_, rewards, reward, valid) in zip(parts, scores):
        part.rewards, part.reward, part.valid = rewards, reward, valid
    return batch
