"""PoolConfig: whether the loop runs in per-phase pods or in a Ray pool that keeps the GPU state warm."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from unirl_core.errors import ConfigError, field_error

Execution = Literal["pods", "pool"]
Placement = Literal["colocate", "separate"]
Emit = Literal["projection", "full"]
Publish = Literal["collective", "object_store"]


@dataclass(frozen=True, kw_only=True)
class ActorResources:
    """What one actor of a role reserves in the pool's placement group."""

    num_cpus: float = 1.0
    """CPUs reserved per actor; the actor also runs torch with ``max(1, int(num_cpus))`` threads."""
    num_gpus: float = 0.0
    """GPUs reserved per actor (fractions share a GPU, e.g. 0.5 + 0.5 when colocated)."""

    def check(self, where: str) -> None:
        for name in ("num_cpus", "num_gpus"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise field_error(ConfigError, f"{where}.{name}", v, "a finite number >= 0", "e.g. 1")


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """The run's Ray pool: engine, trainer and reward actors that live for the run (``execution: pool``)."""

    execution: Execution = "pods"
    """``pods``: every phase rebuilds its model / optimizer from the checkpoint (each task its own process).
    ``pool``: the phases hand their step to long-lived Ray actors that keep model, optimizer and engine warm;
    trajectory tensors go rollout -> trainer through the Ray object store, weights trainer -> engine in-pool."""
    address: str | None = None
    """``None``: start a local Ray head on 127.0.0.1 (stopped at interpreter exit), or use the Ray this
    process is already connected to; else ``host:port`` of a running cluster's GCS (or ``ray://host:port``)
    to attach to. Token authentication stays on: attach with the cluster's token in the environment."""
    placement: Placement = "colocate"
    """``colocate``: all actors in one placement-group bundle (one node, fractional GPUs shared);
    ``separate``: one bundle per actor (engines, trainer and rewards on their own devices)."""
    num_engines: int = 1
    """Engine actors; rollout shard ``i`` runs on engine ``i % num_engines``."""
    engine: ActorResources = field(default_factory=ActorResources)
    """Resources of each engine actor (rollout bundle + trainside engine)."""
    trainer: ActorResources = field(default_factory=ActorResources)
    """Resources of the trainer actor (TrainBackend with resident optimizer state)."""
    reward: ActorResources = field(default_factory=lambda: ActorResources(num_cpus=0.0))
    """Resources of the reward actor (RewardService). CPU-only scorers need none of their own."""
    emit: Emit = "projection"
    """What the rollout phase returns as its SampleBatch artifact: ``projection`` (media, text, tokens,
    log-probs, rewards; diffusion latents emptied and replay conditions dropped) or ``full`` trajectories."""
    publish: Publish = "collective"
    """How a published version reaches the engines: ``collective`` broadcasts it from the trainer actor over a
    torch.distributed group of trainer + engines (NCCL on GPUs, gloo on CPU; ``unirl_core.train.weight_sync``),
    ``object_store`` sends the trainer's state dict through Ray's object store. Either way an engine that
    missed a version loads it from the checkpoint store before its next rollout."""
    sync_bucket_mb: float = 256.0
    """Bucket size of the collective publish (MiB): a sharded trainer gathers one bucket at a time on its
    device, so this bounds the extra memory of a publish (plus the largest single tensor)."""
    sync_timeout_s: float = 300.0
    """Rendezvous and per-collective timeout of the publish group; a peer that vanished fails the publish
    after it (the engines then load the version from the store)."""
    placement_timeout_s: float = 60.0
    """How long setup waits for the placement group before failing with the resources it asked for."""
    connect_timeout_s: float = 10.0
    """How long setup waits for ``address`` to accept a connection."""
    call_timeout_s: float = 7200.0
    """Upper bound of one actor call (a rollout, a train step); past it the phase raises a TransientError."""

    def __post_init__(self) -> None:
        if not (isinstance(self.num_engines, int) and self.num_engines >= 1):
            raise field_error(ConfigError, "pool.num_engines", self.num_engines, "an integer >= 1", "use 1")
        for role in ("engine", "trainer", "reward"):
            getattr(self, role).check(f"pool.{role}")
        if self.publish not in ("collective", "object_store"):
            raise field_error(ConfigError, "pool.publish", self.publish, "'collective' or 'object_store'",
                              "use 'collective' (NCCL / gloo broadcast trainer -> engines)")
        for name in ("placement_timeout_s", "connect_timeout_s", "call_timeout_s", "sync_bucket_mb",
                     "sync_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                unit = "MiB" if name.endswith("_mb") else "seconds"
                raise field_error(ConfigError, f"pool.{name}", v, f"a finite number of {unit} > 0", "e.g. 60")
        if self.address is not None and not self.address.strip():
            raise field_error(ConfigError, "pool.address", self.address, "None or host:port",
                              "leave it unset to start a local head")
