"""The loop's phases in pool mode: same inputs and outputs as ``unirl_core.loop.phases``, run by the pool.

The pool's executor (``pool.executor.PoolExecutor``) calls these, so ``run_local`` and the Flyte tasks run
either mode unchanged. The advantage phase stays on the driver (a cheap pure function of the projection).
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from typing import Literal

from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, PoolActorDied, field_error
from unirl_core.runtime import build
from unirl_core.pool import actors, group
from unirl_core.pool.cluster import REWARD, Pool, engine_name
from unirl_core.pool.shared import SHARED
from unirl_core.pool import tenants  # noqa: F401 - registers the named pool with Pool.get
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)


def _engine_of(cfg: RunConfig, shard: int) -> str:
    if _shared(cfg):
        return SHARED
    return engine_name(shard % cfg.pool.num_engines)


def _shared(cfg: RunConfig) -> bool:
    """``pool.placement: shared``: the trainer's process is the engine (``unirl_core/pool/shared.py``)."""
    return cfg.pool.placement == "shared"


def rollout_phase(cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int = 0, num_shards: int = 1,
                  weights: Literal["policy", "ema"] = "policy") -> tuple[SampleBatch, dict[str, float]]:
    """Sample one shard on its engine actor; returns the projection (``pool.emit``) and the metrics. The full
    batch stays in the pool for ``train_phase``."""
    pool, name, what = Pool.get(cfg), _engine_of(cfg, shard), f"rollout step {step} shard {shard}"
    # the shared actor's module samples its EMA too; engine actors hold the policy only (config refuses EMA
    # rollouts there)
    extra = (weights,) if _shared(cfg) else ()
    return pool.call(name, "rollout", ckpt, step, shard, num_shards, cfg.pool.emit, *extra, what=what)


def submit_rollout(cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int,
                   num_shards: int) -> Future:
    """``rollout_phase`` without waiting: a Future of (projection, metrics) for the rollout manager (lagged
    rollouts). The engine runs its calls in order, so a publish queued after it waits for it (the manager also
    quiesces before publishing); a dead engine sets ``PoolActorDied`` naming it."""
    name = _engine_of(cfg, shard)
    return Pool.get(cfg).submit(name, "rollout", ckpt, step, shard, num_shards, cfg.pool.emit,
                                what=f"rollout step {step} shard {shard} (v{ckpt.policy_version})")


def reward_phase(cfg: RunConfig, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
    """Score the projection on the reward actor (the scores come back, not the batch)."""
    scores, metrics = Pool.get(cfg).call(REWARD, "score", batch, what=f"reward of {len(batch)} samples")
    return actors.apply_scores(batch, scores), metrics


def train_phase(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *, step: int,
                background: bool = False) -> tuple[CheckpointRef, dict[str, float]]:
    """Train step ``step`` on the trainer actor from the full batches the engines hold, with ``batch``'s
    (the scored projection's) advantages. A shard the pool no longer holds (its engine restarted, or the
    rollout came from a task cache) is sampled again from ``ckpt`` with the same seed and checked against
    the projection's log-probs before training (the shared actor trains on the batches it holds: none travel).
    ``background`` (one trainer rank): the trainer writes the version on its writer thread and the ref returns
    before it exists (``publish_when_written``, ``wait_written``)."""
    pool, shards, what = Pool.get(cfg), cfg.loop.rollout_shards, f"train step {step}"
    # a shard sampled again with what the loop's rollouts sample with (engine actors: the policy only)
    weights = (build.rollout_weights(cfg),) if _shared(cfg) else ()
    refs, resampled = [], 0
    for shard in range(shards):
        got, again = held_or_sampled(pool, _engine_of(cfg, shard), ("batch_ref", step, shard),
                                     (ckpt, step, shard, shards, "projection", *weights),
                                     what=f"{what}: fetching shard {shard}")
        refs, resampled = refs + got, resampled + again
    ref, metrics = group.call(pool, "train_background" if background else "train", ckpt, step, batch, *refs,
                              what=what)
    for name in sorted({_engine_of(cfg, s) for s in range(shards)}):
        pool.remote(name, "release", step)  # not waited for: a lost release only keeps a batch until the next
    metrics["pool/resampled_shards"] = float(resampled)
    return ref, metrics


def held_or_sampled(pool: Pool, name: str, query: tuple, rollout: tuple, *, what: str) -> tuple[list, int]:
    """The ObjectRefs of the full batches actor ``name`` holds (``query``: its method and arguments, answering None
    when it holds none), sampled again first (``rollout``: the arguments of its rollout) when it holds none - it
    restarted since the rollout, or the rollout came from a task cache: the same version and seed sample the same
    again, and the trainer checks their log-probs against the scored projection's. Returns the refs and 1 when it
    sampled again, else 0."""
    got = pool.call(name, *query, what=what)
    if got is not None:
        return got, 0
    log.warning("pool: %s holds nothing for %s; sampling it again", name, what)
    pool.call(name, "rollout", *rollout, what=f"re-sampling {what}")
    return pool.call(name, *query, what=what) or [], 1


def publish_when_written(cfg: RunConfig, ckpt: CheckpointRef) -> bool:
    """Have the trainer's writer thread publish ``ckpt`` once written (``train_phase(background=True)``); False
    when the trainer is not writing it (the caller publishes it from the store)."""
    pool = Pool.get(cfg)
    return bool(pool.call(group.rank0(pool), "publish_version", ckpt, what=f"publish v{ckpt.policy_version}"))


def prune_versions(cfg: RunConfig) -> None:
    """The store's retention after a publish, on the trainer actor's writer thread (off the step's path); a pool
    without a live trainer applies it here."""
    pool = Pool.get(cfg)
    try:
        pool.call(group.rank0(pool), "prune_versions", what="retention")
    except PoolActorDied as e:
        log.warning("pool: retention in the trainer skipped (%s); applying it here", e)
        build.store(cfg).apply_retention()


def wait_written(cfg: RunConfig, ckpt: CheckpointRef) -> None:
    """Wait for the trainer's background write of ``ckpt`` (and its publish); raises its failure. A trainer that
    died meanwhile took the write with it: ``CheckpointError`` naming the version (``LATEST`` names the one
    before it)."""
    from unirl_core.pool.cluster import current_pool

    pool = current_pool()
    try:
        if pool is None or group.rank0(pool) not in pool.live:
            raise PoolActorDied(f"the pool of run {cfg.name!r} (or its trainer) is gone")
        pool.call(group.rank0(pool), "wait_version", what=f"writing {ckpt.uri}")
    except PoolActorDied as e:
        raise field_error(CheckpointError, ckpt.uri, f"not written: {e}", "a complete version",
                          f"the trainer that was writing it in the background is gone; the run's LATEST names the "
                          f"version before step {ckpt.step}: resume from it") from e


def _publish_shared(pool: Pool, ckpt: CheckpointRef, t0: float) -> dict[str, float]:
    """Shared placement: the engine samples with the trainer's module, so the version is published once the
    trainer holds it; nothing moves. A restarted actor holds nothing: its next rollout restores the version."""
    held = bool(pool.call(SHARED, "holds", ckpt, what=f"publish v{ckpt.policy_version}"))
    return {"pool/engines_pushed": 0.0, "pool/publish_collective": 0.0, "pool/publish_shared": 1.0,
            "pool/publish_bytes": 0.0, "pool/publish_delta": 0.0, "pool/publish_resent_full": 0.0,
            "pool/engines_serving": float(held),
            "pool/publish_s": time.perf_counter() - t0}


def publish_weights(cfg: RunConfig, ckpt: CheckpointRef) -> dict[str, float]:
    """After ``ckpt`` is the run's published version: the trainer's weights to every engine, in-pool.

    ``pool.publish: collective`` broadcasts them from the trainer actor over a torch.distributed group of the
    trainer and the engines (NCCL on GPUs, gloo on CPU; opened on first use and again after an actor was
    re-created); ``object_store`` (and engines that share the trainer's GPU, where NCCL refuses two ranks)
    passes the state dict through Ray's object store. Engines that all serve ``ckpt`` already are skipped
    (nothing is published twice). Delta versions (``checkpoint.weights_encoding: delta``): a collective publish
    sends the version as a delta on the wire against the previous publish when every engine holds that one
    bitwise (``pool/publish_delta``), full otherwise; the store's delta file is read (``_deltas``) only when the
    version does not go over the collective (object-store publish, a colocated GPU, a trainer that does not hold
    it). A dead actor or a trainer holding another version is not an error here:
    the version is in the store, and an engine that missed it loads it from there before its next rollout.
    An engine whose tensors do not fit the trainer's refuses the broadcast: ``WeightSyncError`` naming the
    tensor, raised."""
    pool = Pool.get(cfg)
    t0 = time.perf_counter()
    if _shared(cfg):
        return _publish_shared(pool, ckpt, t0)
    want = (ckpt.uri, ckpt.policy_version)
    engines = [engine_name(i) for i in range(cfg.pool.num_engines)]
    out = {"pool/engines_pushed": 0.0, "pool/publish_collective": 0.0, "pool/publish_delta": 0.0,
           "pool/publish_resent_full": 0.0}
    served: dict[str, tuple] | None = None
    try:
        served = {name: tuple(pool.call(name, "served_version", what="publish") or ()) for name in engines}
        stale = [name for name in engines if served[name] != want]
        held = bool(stale) and group.holds(pool, ckpt)
        # the wire carries its own delta (against what the engines hold, from the trainer's memory): no store read
        collective = held and cfg.pool.publish == "collective" and _collective_fits(pool, engines)
        if stale and not collective and build.store(cfg).encoding.deltas:
            fed = _deltas(pool, stale, ckpt)
            out["pool/engines_fed_delta"] = float(len(fed))
            served.update(dict.fromkeys(fed, want))
            stale = [name for name in stale if name not in fed]
        if collective:
            out.update(_broadcast(pool, engines, ckpt))
            served = dict.fromkeys(engines, want)  # each receive checked the version it got
        elif stale and held:
            pushed = _through_object_store(pool, stale, ckpt)
            out.update(pushed)
            if pushed:
                served.update(dict.fromkeys(stale, want))
    except PoolActorDied as e:
        log.warning("pool: in-pool publication of %s skipped (%s); engines load it from the store", ckpt.uri, e)
        served = {name: tuple(pool.call(name, "served_version", what="publish") or ()) for name in engines}
    out["pool/engines_serving"] = float(sum(v == want for v in served.values()))
    out["pool/publish_s"] = time.perf_counter() - t0
    return out


def _deltas(pool: Pool, stale: list[str], ckpt: CheckpointRef) -> list[str]:
    """The engines among ``stale`` that took ``ckpt`` as a delta on the version they serve (``EngineActor.apply_delta``:
    the version's delta file from the store, checked against its digest); the others get it in full."""
    pending = [(name, pool.actor(name).apply_delta.remote(ckpt)) for name in stale]
    return [name for name, r in pending if pool.wait(name, r, what=f"publish v{ckpt.policy_version} (delta)")]


def _collective_fits(pool: Pool, engines: list[str]) -> bool:
    """False when an engine shares a GPU with the trainer (a colocated fractional GPU): NCCL refuses two ranks
    on one device, so those versions go through the object store."""
    for node, gpus in group.placements(pool):
        for name in engines:
            other_node, other_gpus = pool.remembered(name, "placement", what="publish")  # an actor does not move
            if other_node == node and set(gpus) & set(other_gpus):
                log.info("pool: %s shares GPU %s with a trainer rank; publishing through the object store", name,
                         sorted(set(gpus) & set(other_gpus)))
                return False
    return True


def _sync_token(pool: Pool, name: str) -> str | None:
    """The publish group actor ``name`` is in. Remembered between steps only when this process is the pool's one
    driver (no ``pool.address``): attached, another task process may re-open the group on the same actors."""
    return pool.remembered(name, "current_sync", what="publish", again=pool.detached)


def _gather(pool: Pool, calls: list[tuple[str, object]], what: str) -> list:
    """Wait for every call of one collective; when any failed, close the publish group on every actor that is
    still alive and raise the first failure (a dead actor's ``PoolActorDied`` first)."""
    try:
        return group.wait_all(pool, calls, what=what)
    except Exception:
        for name, _ in calls:
            pool.memo(name).pop("current_sync", None)
            if name in pool.live:
                try:
                    pool.call(name, "close_sync", what="closing the publish group")
                except PoolActorDied:
                    pass
        raise


def _broadcast(pool: Pool, engines: list[str], ckpt: CheckpointRef) -> dict[str, float]:
    trainers = group.names(pool)
    members = [*trainers, *engines]
    # engines are asked every time: a vLLM engine actor leaves the group when its server is replaced
    tokens = {_sync_token(pool, name) for name in trainers} | \
        {pool.call(name, "current_sync", what="publish") for name in engines}
    opened = 0.0
    if len(tokens) != 1 or None in tokens:  # first publish, or an actor (or a server) was re-created since
        token = uuid.uuid4().hex
        addr, port = pool.call(trainers[0], "sync_endpoint", what="publish")
        dtypes = pool.call(engines[0], "sync_dtypes", what="publish")
        # 1 rank per engine, 2 for a vLLM engine actor (its bundle and its server's worker); an actor keeps its kind
        counts = [int(pool.remembered(name, "sync_ranks", what="publish")) for name in engines]
        firsts = [1 + sum(counts[:i]) for i in range(len(engines))]
        n = sum(counts)
        # the other trainer ranks follow rank 0's sends (their shards' gathers) with the same casts
        # a vLLM engine actor's server worker (its second rank) takes full weights only: no wire deltas then
        wire_deltas = all(c == 1 for c in counts)
        calls = [(name, pool.remote(name, "open_sync", token, addr, port, n, dtypes, wire_deltas))
                 for name in trainers]
        calls += [(name, pool.actor(name).join_sync.remote(token, addr, port, first, n))
                  for first, name in zip(firsts, engines)]
        _gather(pool, calls, "opening the publish group")
        for name in members:
            pool.memo(name)["current_sync"] = token
        opened = 1.0
    what = f"publish v{ckpt.policy_version} (collective)"
    calls = [(name, pool.remote(name, "broadcast_weights", ckpt)) for name in trainers]
    calls += [(name, pool.actor(name).receive_weights.remote(ckpt)) for name in engines]
    sent, *received = _gather(pool, calls, what)
    received = received[len(trainers) - 1:]
    return {"pool/engines_pushed": float(len(received)), "pool/publish_collective": 1.0,
            "pool/publish_group_opened": opened, "pool/publish_bytes": sent["bytes"],
            "pool/publish_delta": sent["delta"], "pool/publish_resent_full": sent["resent_full"],
            "pool/publish_send_s": sent["seconds"]}


def _through_object_store(pool: Pool, stale: list[str], ckpt: CheckpointRef) -> dict[str, float]:
    weights = group.call(pool, "weights", ckpt, what=f"publish v{ckpt.policy_version}")
    if not weights:
        return {}
    pending = [(name, pool.actor(name).load_weights.remote(weights[0], ckpt)) for name in stale]
    for name, r in pending:
        pool.wait(name, r, what=f"publish v{ckpt.policy_version}")
    return {"pool/engines_pushed": float(len(pending))}
