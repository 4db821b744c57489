"""PoolConfig: whether the loop runs in per-phase pods or in a Ray pool that keeps the GPU state warm."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from unirl_core.config.loader import refuse
from unirl_core.errors import ConfigError, check_ints, field_error

Execution = Literal["pods", "pool"]
Placement = Literal["colocate", "separate", "shared"]
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


RAY_VERSION = "2.60.0"
"""The ray pin of the ``pool`` extra (pyproject.toml); a KubeRay cluster must run the same."""


@dataclass(frozen=True, kw_only=True)
class KubeRayConfig:
    """A KubeRay RayCluster for the pool (``unirl_core/pool/kuberay.py`` generates and validates its spec)."""

    image: str = ""
    """Container image of head and workers (the train image: it holds torch, the models and ray). Required."""
    ray_version: str = RAY_VERSION
    """``spec.rayVersion``; must be the Ray installed in the image."""
    name: str | None = None
    """RayCluster name (DNS-1123); None: ``<run>-pool``."""
    namespace: str = "default"
    """Kubernetes namespace of the cluster."""
    head_cpus: float = 2.0
    """CPUs of the head pod (it runs the GCS, no actors)."""
    head_memory: str = "8Gi"
    """Memory of the head pod (a Kubernetes quantity)."""
    worker_replicas: int = 1
    """Worker pods (fixed size: min = max = replicas)."""
    worker_cpus: float = 8.0
    """CPUs per worker pod."""
    worker_gpus: int = 0
    """GPUs per worker pod (``gpu_resource``)."""
    worker_memory: str = "64Gi"
    """Memory per worker pod."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name of a GPU on the cluster's nodes."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """nodeSelector of every pod (e.g. ``{"nvidia.com/gpu.product": "NVIDIA-H200"}``)."""
    service_account: str | None = None
    """serviceAccountName of every pod (storage credentials through IRSA / workload identity)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.image, str) and self.image.strip()):
            raise field_error(ConfigError, "pool.kuberay.image", self.image, "a container image",
                              "set it to the train image (pyflyte --image, or the ImageSpec's built name)")
        check_ints("pool.kuberay", self, ("worker_replicas",), "e.g. 1")
        check_ints("pool.kuberay", self, ("worker_gpus",), "GPUs are whole devices in Kubernetes", minimum=0)
        for name in ("head_cpus", "worker_cpus"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise field_error(ConfigError, f"pool.kuberay.{name}", v, "a number of CPUs > 0", "e.g. 8")


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
    ``separate``: one bundle per actor (engines, trainer and rewards on their own devices);
    ``shared``: one actor process (``shared``, with ``trainer``'s resources) hosts the trainer and the trainside
    engine, which samples with the trainer's own module in its compute context: one copy of the weights, and a
    publish moves no bytes. Needs ``num_engines`` 1, ``trainer_ranks`` 1, no policy lag, an unsharded trainer."""
    num_engines: int = 1
    """Engine actors; rollout shard ``i`` runs on engine ``i % num_engines``."""
    engine: ActorResources = field(default_factory=ActorResources)
    """Resources of each engine actor (rollout bundle + trainside engine)."""
    trainer: ActorResources = field(default_factory=ActorResources)
    """Resources of the trainer actor (TrainBackend with resident optimizer state)."""
    trainer_ranks: int = 1
    """Trainer actors, one per rank (each with ``trainer``'s resources: one GPU each on GPUs, gloo on CPU), sharding
    the policy with FSDP2 over a torch.distributed group of their own; rank 0 returns the metrics, writes the
    version and sends the publish, the others follow every call. 1: one unsharded trainer actor (``trainer``)."""
    reward: ActorResources = field(default_factory=lambda: ActorResources(num_cpus=0.0))
    """Resources of the reward actor (RewardService). CPU-only scorers need none of their own."""
    emit: Emit = "projection"
    """What the rollout phase returns as its SampleBatch artifact: ``projection`` (media, text, tokens,
    log-probs, rewards; diffusion latents emptied and replay conditions dropped) or ``full`` trajectories."""
    publish: Publish = "collective"
    """How a published version reaches the engines: ``collective`` broadcasts it from the trainer actor over a
    torch.distributed group of trainer + engines (NCCL on GPUs, gloo on CPU; ``unirl_core.weightsync.sync``),
    ``object_store`` sends the trainer's state dict through Ray's object store. Either way an engine that
    missed a version loads it from the checkpoint store before its next rollout."""
    sync_bucket_mb: float = 256.0
    """Bucket size of the collective publish (MiB): a sharded trainer gathers one bucket at a time on its
    device, so this bounds the extra memory of a publish (plus the largest single tensor)."""
    sync_timeout_s: float = 300.0
    """Rendezvous and per-collective timeout of the publish group; a peer that vanished fails the publish
    after it (the engines then load the version from the store)."""
    kuberay: KubeRayConfig | None = None
    """A KubeRay RayCluster the setup task writes as ``<checkpoint.root>/<run>/pool/raycluster.yaml`` (validated
    against the placement the pool asks for); apply it with kubectl and attach with ``address``."""
    placement_timeout_s: float = 60.0
    """How long setup waits for the placement group before failing with the resources it asked for."""
    connect_timeout_s: float = 10.0
    """How long setup waits for ``address`` to accept a connection."""
    call_timeout_s: float = 7200.0
    """Upper bound of one actor call (a rollout, a train step); past it the phase raises a TransientError."""
    name: str | None = None
    """A named, long-lived pool (``unirl_core/pool/tenants.py``) that runs of LoRA recipes attach to: its actors
    and placement group are detached, named ``<name>-<role>``, and outlive the driver; each run is a tenant with its
    own adapter, optimizer, engine state and reward scorers in those processes. Created by the first run that names
    it (with that run's ``pool.*`` resources), ended by ``idle_timeout_s``. None: a pool of the run's own."""
    idle_timeout_s: float = 900.0
    """A named pool (``name``) drops a run's tenants idle this long (a driver that died), and tears itself down (its
    actors and placement group) once no run has been attached for this long."""
    worker_setup_hook: str | None = None
    """``"module:function"`` called with no arguments in every actor process before it builds anything (e.g. to
    register a custom model builder or scorer the actors must see); the module must be importable there (installed
    in the image, or on ``PYTHONPATH`` when the pool starts its own head)."""

    def __post_init__(self) -> None:
        check_ints("pool", self, ("num_engines",), "use 1")
        check_ints("pool", self, ("trainer_ranks",),
                   "use 1 (one trainer actor), or the number of GPUs to shard the policy over")
        for role in ("engine", "trainer", "reward"):
            getattr(self, role).check(f"pool.{role}")
        if self.placement == "shared":
            for name, why in (("num_engines", "the trainer's process is the one engine"),
                              ("trainer_ranks", "a sharded (FSDP2) module cannot sample as the trainside engine")):
                if getattr(self, name) != 1:
                    raise field_error(ConfigError, f"pool.{name}", getattr(self, name), "1 with pool.placement="
                                      f"'shared' ({why})", "use placement 'colocate' or 'separate' for more")
        if self.publish not in ("collective", "object_store"):
            raise field_error(ConfigError, "pool.publish", self.publish, "'collective' or 'object_store'",
                              "use 'collective' (NCCL / gloo broadcast trainer -> engines)")
        for name in ("placement_timeout_s", "connect_timeout_s", "call_timeout_s", "sync_bucket_mb",
                     "sync_timeout_s", "idle_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                unit = "MiB" if name.endswith("_mb") else "seconds"
                raise field_error(ConfigError, f"pool.{name}", v, f"a finite number of {unit} > 0", "e.g. 60")
        hook = self.worker_setup_hook
        if hook is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", str(hook)):
            raise field_error(ConfigError, "pool.worker_setup_hook", hook, "'module:function' (a dotted module path, "
                              "a colon, a function name)", "e.g. 'my_project.pool_setup:register'")
        if self.name is not None and not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,46}[a-z0-9])?", str(self.name)):
            raise field_error(ConfigError, "pool.name", self.name, "a lowercase DNS-style label (a-z, 0-9, '-', at "
                              "most 48 characters)", "e.g. 'sd35m-lora'")
        if self.address is not None and not self.address.strip():
            raise field_error(ConfigError, "pool.address", self.address, "None or host:port",
                              "leave it unset to start a local head")


def check_pool_features(cfg) -> None:
    """Refuse what the pool's actors do not run (``cfg``: the RunConfig); each names the field and the way out."""
    if cfg.pool.execution != "pool":
        return
    lm = cfg.lm
    refused = [
        ("filter_groups", cfg.filter_groups is not None, "dynamic sampling's extra rounds run in pods mode only"),
        ("async_training.partial_rollout", cfg.async_training.partial_rollout is not None, "partial rollouts "
         "continue on the driver's decoder, not on the pool's engines yet (the lag itself runs in the pool)"),
        ("lm.agent", lm is not None and lm.agent is not None, "agentic rollouts have not run on the pool's engine "
         "actors (its Arrow projection also drops the turn structure the deck shows)"),
    ]
    refuse([(name, "set", is_set, "unset with pool.execution='pool'", f"{why}; remove it or use execution 'pods'")
            for name, is_set, why in refused])


def check_named(cfg) -> None:
    """What a run attaching to a named pool (``pool.name``) needs (``cfg``: the RunConfig): a LoRA run (its tenant
    holds an adapter and its optimizer; a full fine-tune keeps a pool of its own), one trainer rank (a rank's
    torch.distributed group is its process's, which tenants share) and the object-store publish (a collective
    group per tenant in one process is not built)."""
    if cfg.pool.execution != "pool" or cfg.pool.name is None:
        return
    p, finetune = cfg.pool, cfg.section.model.finetune
    why = "with pool.name (a named pool hosts LoRA runs as tenants)"
    refuse([
        ("pool.name", p.name, finetune != "lora", f"unset with {cfg.family}.model.finetune={finetune!r}",
         f"a full fine-tune keeps a pool of its own: unset pool.name, or set {cfg.family}.model.finetune=lora"),
        ("pool.trainer_ranks", p.trainer_ranks, p.trainer_ranks != 1, "1 " + why,
         "sharded trainers of several runs in one process are not built; unset pool.name to shard"),
        ("pool.placement", p.placement, p.placement == "shared", "'colocate' or 'separate' " + why,
         "use placement 'colocate'"),
        ("pool.publish", p.publish, p.publish != "object_store", "'object_store' " + why,
         "set pool.publish=object_store (one publish group per tenant in a shared process is not built)"),
        ("train.weights_scope", cfg.train.weights_scope, cfg.train.weights_scope != "trainable", "'trainable' " + why,
         "set train.weights_scope=trainable: a full-state version loads into the base tensors the pool's tenants "
         "share"),
    ])


def check_shared(cfg) -> None:
    """What ``pool.placement: shared`` needs of the rest of the run (``cfg``: the RunConfig): the one module holds
    the trainer's current version, so a rollout cannot pin an older one (no policy lag), and it must not be
    FSDP-wrapped (``train.shard: always``), which the trainside engine cannot sample through."""
    if cfg.pool.execution != "pool" or cfg.pool.placement != "shared":
        return
    lag = cfg.async_training.max_policy_lag
    refuse([("async_training.max_policy_lag", lag, lag != 0, "0 with pool.placement='shared' (the engine samples "
             "with the trainer's current weights, it cannot hold an older version)",
             "use placement 'colocate' or 'separate' (engines of their own) for lagged rollouts"),
            ("train.shard", "always", cfg.train.shard == "always", "'auto' with pool.placement='shared' (one "
             "unsharded trainer the engine samples through)", "set train.shard: auto")])


def check_dedicated(cfg) -> None:
    """What a pool run with a dedicated LM engine needs (``cfg``: the RunConfig). Built: one engine actor that
    starts and owns a vLLM server (``unirl_core/pool/vllm_actor.py``); full weights reach it through the trainer's
    broadcast (``pool.publish: collective``, the server's worker one more rank of the publish group) or through
    Ray's object store and a staged folder; a LoRA adapter through the object store. Everything else is refused
    here."""
    if cfg.pool.execution != "pool" or cfg.lm is None or cfg.lm.deployment.engine == "trainside":
        return
    lm, p = cfg.lm, cfg.pool
    kind = lm.deployment.engine
    want = f"with pool.execution='pool' and lm.deployment.engine={kind!r}"
    if kind != "vllm":  # the rest reads lm.vllm
        raise field_error(ConfigError, "lm.deployment.engine", kind, "'trainside' or 'vllm' with pool.execution="
                          "'pool'", "the pool owns vLLM servers only (SGLang is attached, not started); use "
                          "execution 'pods'")
    refuse([
        ("pool.placement", p.placement, p.placement == "shared", "'colocate' or 'separate' " + want,
         "a vLLM server samples, not the trainer's module; use placement 'colocate'"),
        ("pool.num_engines", p.num_engines, p.num_engines != 1, "1 " + want,
         "one engine actor owns one server (several servers have not run); set pool.num_engines=1"),
        ("pool.publish", p.publish, p.publish != "object_store" and lm.deployment.sync.method != "reload",
         "'object_store' " + want + " and lm.deployment.sync.method='lora'",
         "the server loads an adapter from a folder (its LoRA manager), not from the trainer's broadcast; set "
         "pool.publish=object_store"),
        ("async_training.max_policy_lag", cfg.async_training.max_policy_lag, cfg.async_training.max_policy_lag != 0,
         "0 " + want, "lagged rollouts have not run on a vLLM engine actor; use execution 'pods' for them"),
        ("lm.deployment.mode", lm.deployment.mode, lm.deployment.mode != "separate", "'separate' " + want,
         "sleep / wake beside the trainer actor is not built; use mode 'separate'"),
        ("lm.vllm.base_url", lm.vllm.base_url, lm.vllm.base_url is not None, "None " + want,
         "the engine actor starts and owns its server; leave base_url unset (or use execution 'pods' to attach)"),
    ])
