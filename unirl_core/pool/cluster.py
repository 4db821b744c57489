"""The driver side of the pool: connect to Ray, reserve the placement group, create actors, call them.

``Pool.get(cfg)`` is a per-process singleton keyed by the run's config: every phase of a process (``run_local``,
a local ``pyflyte run``) talks to the same actors. Actors are named ``<run>-<config digest>-<role>`` in the
``unirl`` namespace; when the pool attaches to a cluster (``pool.address``) they are detached, so the phase
tasks of one run, each its own process, find them by name.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import socket
import sys
from concurrent.futures import Future
from dataclasses import dataclass

from unirl_core.config.loader import config_key
from unirl_core.config.run import RunConfig
from unirl_core.errors import ConfigError, PoolActorDied, TransientError, field_error
from unirl_core.pool import actors, transport
from unirl_core.config.pool import ActorResources, PoolConfig
from unirl_core.pool.group import trainer_names

log = logging.getLogger(__name__)

NAMESPACE = "unirl"
REWARD = "reward-0"


def engine_name(index: int) -> str:
    return f"engine-{index}"


@dataclass(frozen=True)
class _Role:
    name: str
    cls: type
    resources: ActorResources
    field: str
    """Config field of its resources (``pool.engine``)."""


def engine_class(cfg: RunConfig) -> type:
    """The engine actor of a run: one that owns a vLLM server (``pool/vllm_actor.py``) or the trainside one."""
    if cfg.family == "lm" and cfg.lm.deployment.engine == "vllm":
        from unirl_core.pool.vllm_actor import VLLMEngineActor

        return VLLMEngineActor
    return actors.EngineActor


def _roles(pcfg: PoolConfig, engine_cls: type = actors.EngineActor) -> list[_Role]:
    if pcfg.placement == "shared":  # trainer and engine in one process, with the trainer's resources
        from unirl_core.pool.shared import SHARED, SharedActor

        return [_Role(SHARED, SharedActor, pcfg.trainer, "pool.trainer"),
                _Role(REWARD, actors.RewardActor, pcfg.reward, "pool.reward")]
    engines = [_Role(engine_name(i), engine_cls, pcfg.engine, "pool.engine") for i in range(pcfg.num_engines)]
    trainers = [_Role(n, actors.TrainerActor, pcfg.trainer, "pool.trainer") for n in trainer_names(pcfg.trainer_ranks)]
    return [*engines, *trainers, _Role(REWARD, actors.RewardActor, pcfg.reward, "pool.reward")]


def _needs(r: ActorResources) -> dict[str, float]:
    return {k: v for k, v in (("CPU", r.num_cpus), ("GPU", r.num_gpus)) if v > 0}


def probe_address(address: str, timeout_s: float) -> None:
    """Raise ConfigError unless ``host:port`` (optionally ``ray://``) accepts a TCP connection in time."""
    hostport = address.removeprefix("ray://").rsplit("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise field_error(ConfigError, "pool.address", address, "host:port of a Ray cluster's GCS (or ray://host:port)",
                          "e.g. 10.0.0.5:6379, or leave it unset to start a local head")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise field_error(ConfigError, "pool.address", address, f"a Ray cluster answering within "
                          f"pool.connect_timeout_s={timeout_s} s ({type(e).__name__}: {e})",
                          "start the cluster (ray start --head) or fix the address; leave it unset to start a "
                          "local head") from None


def connect_error(address: str, error: BaseException) -> ConfigError | None:
    """A ConfigError naming the fix when Ray refused this client's token (an ``AuthenticationError`` /
    ``InvalidAuthToken`` anywhere in ``error``'s chain: Ray wraps it in a RuntimeError's text on some paths); None
    for any other failure."""
    seen = error
    while seen is not None:
        text = f"{type(seen).__name__}: {seen}"
        if "AuthenticationError" in text or "InvalidAuthToken" in text:
            return field_error(ConfigError, "pool.address", address, "a Ray cluster that accepts this client's "
                               "token (Ray token authentication refused it: InvalidAuthToken)",
                               "run with the cluster's token: RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH / "
                               "~/.ray/auth_token names")
        seen = seen.__cause__ or seen.__context__
    return None


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Read when ``ray`` is imported: "0" makes a head bind 127.0.0.1 only. Otherwise Ray resolves 127.0.0.1 to the
machine's routable address and its GCS and raylet listen on every interface (token auth still guards them)."""


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _connect(pcfg: PoolConfig) -> bool:
    """Connect this process to Ray; True when it started a local head (stopped at interpreter exit)."""
    if pcfg.address is not None:
        import ray

        probe_address(pcfg.address, pcfg.connect_timeout_s)
        if not ray.is_initialized():
            try:
                ray.init(address=pcfg.address, log_to_driver=False)
            except ConnectionError as e:
                refused = connect_error(pcfg.address, e)
                if refused is not None:
                    raise refused from e
                raise
            return False
        connected = ray.get_runtime_context().gcs_address
        if pcfg.address.removeprefix("ray://") != connected:
            raise field_error(ConfigError, "pool.address", pcfg.address, f"the cluster this process is connected to "
                              f"({connected})", "leave pool.address unset to use it, or run the pool from a "
                              "process that is not connected to another Ray cluster")
        return False
    if _ray_connected():
        return False
    if "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    import ray

    # "local": a head of our own even when another Ray runs on this machine (None would attach to RAY_ADDRESS)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    log.info("started a local Ray head for the pool at %s", ray.get_runtime_context().gcs_address)
    atexit.register(ray.shutdown)
    return True


class Pool:
    """The run's actors and their placement group. Use ``Pool.get(cfg)``; ``close()`` frees them."""

    def __init__(self, cfg: RunConfig, key: str) -> None:
        self.cfg, self.key = cfg, key
        self.pcfg = cfg.pool
        self.prefix = f"{cfg.name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
        self.detached = self.pcfg.address is not None
        self.started_ray = _connect(self.pcfg)
        transport.register()  # SampleBatch arguments as Arrow IPC, not pickled tensor by tensor
        self.roles = {r.name: r for r in self.make_roles()}
        self.bundle_of: dict[str, int] = {}
        self.pg = self._placement_group()
        self._handles: dict[str, object] = {}
        self._memo: dict[str, dict[str, object]] = {}

    def make_roles(self) -> list[_Role]:
        """The actors of this pool (a compose run's pool has other roles: ``unirl_core/compose/pool.py``)."""
        return _roles(self.pcfg, engine_class(self.cfg))

    def actor_config(self, name: str):
        """The config actor ``name`` is built with (the run's; a compose pool gives each its stack's)."""
        return self.cfg

    # ----------------------------------------------------------------------------- placement

    def _bundles(self) -> list[dict[str, float]]:
        if self.pcfg.placement in ("colocate", "shared"):
            total: dict[str, float] = {}
            for r in self.roles.values():
                for k, v in _needs(r.resources).items():
                    total[k] = total.get(k, 0.0) + v
            self.bundle_of = dict.fromkeys(self.roles, 0)
            return [total]
        bundles = []
        for r in self.roles.values():
            need = _needs(r.resources)
            self.bundle_of[r.name] = len(bundles) if need else -1  # a role without resources: any bundle
            if need:
                bundles.append(need)
        return bundles

    def _check_fits(self, bundles: list[dict[str, float]]) -> None:
        """Fail fast, naming the field, when the cluster could never place the group."""
        import ray

        total = ray.cluster_resources()
        largest: dict[str, float] = {}
        for node in ray.nodes():
            if node.get("Alive"):
                for k, v in node.get("Resources", {}).items():
                    largest[k] = max(largest.get(k, 0.0), v)
        for res in ("CPU", "GPU"):
            ask = sum(b.get(res, 0.0) for b in bundles)
            one = max((b.get(res, 0.0) for b in bundles), default=0.0)
            have, node_max = total.get(res, 0.0), largest.get(res, 0.0)
            if ask <= have + 1e-9 and one <= node_max + 1e-9:
                continue
            blame = max(self.roles.values(), key=lambda r: getattr(r.resources, f"num_{res.lower()}s"))
            attr = f"num_{res.lower()}s"
            asks = {r.name: getattr(r.resources, attr) for r in self.roles.values()}
            field, value = f"{blame.field}.{attr}", getattr(blame.resources, attr)
            extra_ranks = (self.pcfg.trainer_ranks - 1) * getattr(self.pcfg.trainer, attr)
            one_rank = one - extra_ranks if self.pcfg.placement == "colocate" else one  # the bundle with 1 rank
            if extra_ranks > 0 and ask - extra_ranks <= have + 1e-9 and one_rank <= node_max + 1e-9:
                field, value = "pool.trainer_ranks", self.pcfg.trainer_ranks  # one rank would fit: the ranks don't
            raise field_error(ConfigError, field, value,
                              f"a placement ({self.pcfg.placement}) the cluster can hold: the pool asks {ask:g} {res} "
                              f"({asks}), largest bundle {one:g}; the cluster has {have:g} {res}, at most "
                              f"{node_max:g} on one node", f"lower pool.*.{attr}, use pool.placement='separate' to "
                              "spread the actors over nodes, or attach to a larger cluster (pool.address)")

    @property
    def strategy(self) -> str:
        """The placement group's strategy: one node for colocated roles, spread allowed for separate ones."""
        return "PACK" if self.pcfg.placement == "separate" else "STRICT_PACK"

    def _placement_group(self):
        import ray
        from ray.util import get_placement_group, placement_group, remove_placement_group

        name = f"{self.prefix}-pg"
        if self.detached:
            try:
                return get_placement_group(name)  # another task of this run reserved it
            except ValueError:
                pass
        bundles = self._bundles()
        self._check_fits(bundles)
        pg = placement_group(bundles, strategy=self.strategy, name=name, lifetime="detached" if self.detached else None)
        ready, _ = ray.wait([pg.ready()], timeout=self.pcfg.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise field_error(ConfigError, "pool.placement_timeout_s", self.pcfg.placement_timeout_s,
                              f"time to reserve {bundles} ({self.pcfg.placement}); the cluster has "
                              f"{ray.available_resources()} free now", "free the cluster's resources (another "
                              "pool or job holds them), lower pool.*.num_cpus / num_gpus, or raise the timeout")
        log.info("pool %s: placement group %s (%s) ready", self.prefix, bundles, self.pcfg.placement)
        return pg

    # ----------------------------------------------------------------------------- actors

    def actor(self, name: str):
        """The live handle of actor ``name``, created on first use (or after it died)."""
        if name in self._handles:
            return self._handles[name]
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        role = self.roles[name]
        res = role.resources
        opts = {"name": f"{self.prefix}-{name}", "namespace": NAMESPACE, "get_if_exists": True, "max_restarts": 0,
                "num_cpus": res.num_cpus, "num_gpus": res.num_gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=self.bundle_of[name])}
        if self.detached:
            opts["lifetime"] = "detached"
        # queries (batch_ref, release, served_version, ...) run in their own thread while a rollout or train call
        # holds the default group, so a lagged rollout on an engine does not block the trainer fetching its batch
        remote = ray.remote(concurrency_groups={actors.QUERY_GROUP: 1})(role.cls)
        handle = remote.options(**opts).remote(self.actor_config(name), name, max(1, int(res.num_cpus)))
        self._handles[name] = handle
        self._memo.pop(name, None)
        return handle

    def memo(self, name: str) -> dict[str, object]:
        """What this process learned about the current incarnation of actor ``name`` (its placement, its publish
        group), so a step does not ask again; emptied when the handle is dropped or re-created."""
        return self._memo.setdefault(name, {})

    def remembered(self, name: str, method: str, *, what: str, again: bool = False):
        """``call(name, method)``, asked once per incarnation of actor ``name`` (kept in ``memo`` under
        ``method``); ``again``: ask anew."""
        memo = self.memo(name)
        if again or method not in memo:
            memo[method] = self.call(name, method, what=what)
        return memo[method]

    @property
    def live(self) -> list[str]:
        """Names of the actors this process holds handles of (created, not known dead)."""
        return sorted(self._handles)

    def remote(self, name: str, method: str, *args):
        """Start ``actor(name).method(*args)``; returns its ObjectRef. Methods in ``actors.QUERIES`` run in the
        actor's query group (beside a running rollout or train call), every other one in call order."""
        bound = getattr(self.actor(name), method)
        if method in actors.QUERIES:
            bound = bound.options(concurrency_group=actors.QUERY_GROUP)
        return bound.remote(*args)

    def call(self, name: str, method: str, *args, what: str):
        """``actor(name).method(*args)``, waited for at most ``pool.call_timeout_s``. A dead actor raises
        PoolActorDied naming it (and is re-created by the next call); a hung one is killed first."""
        return self.wait(name, self.remote(name, method, *args), what=what)

    def submit(self, name: str, method: str, *args, what: str) -> Future:
        """``call`` without waiting: a Future of the result (for the rollout manager). A dead actor sets
        PoolActorDied naming it, as ``call`` raises it. No timeout: the caller bounds its wait."""
        out: Future = Future()
        ref = self.remote(name, method, *args)

        def done(fut: Future) -> None:
            try:
                out.set_result(fut.result())
            except BaseException as e:  # noqa: BLE001 - handed to the Future's owner, typed like call()'s
                out.set_exception(self._died(name, e, what) or e)

        ref.future().add_done_callback(done)
        return out

    def _died(self, name: str, error: BaseException, what: str) -> PoolActorDied | None:
        """PoolActorDied naming ``name`` when ``error`` says the actor is gone (its handle is dropped), else None."""
        from ray.exceptions import RayActorError

        if not isinstance(error, RayActorError):
            return None
        self._handles.pop(name, None)
        self._memo.pop(name, None)
        died = PoolActorDied(f"pool actor {name!r} of run {self.cfg.name!r} ({self.prefix}-{name}) died during "
                             f"{what}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}; "
                             "the next call re-creates it from the last published version (retry the phase)")
        died.__cause__ = error
        return died

    def wait(self, name: str, ref, *, what: str):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(ref, timeout=self.pcfg.call_timeout_s)
        except RayActorError as e:
            raise self._died(name, e, what) from e
        except GetTimeoutError as e:
            self.kill(name)
            raise TransientError(f"pool actor {name!r} of run {self.cfg.name!r} did not finish {what} within "
                                 f"pool.call_timeout_s={self.pcfg.call_timeout_s} s; it was killed and the next "
                                 "call re-creates it") from e

    def kill(self, name: str, *, named: bool = False) -> None:
        """Kill this process's handle of actor ``name``; ``named``: also the actor of that name that another process
        of the run created."""
        import ray

        handle = self._handles.pop(name, None)
        self._memo.pop(name, None)
        for actor in (handle, self.named(name) if named else None):
            if actor is not None:
                ray.kill(actor, no_restart=True)

    def named(self, name: str):
        """The live actor ``name`` of this run, whichever process created it; None when there is none."""
        import ray

        try:
            return ray.get_actor(f"{self.prefix}-{name}", namespace=NAMESPACE)
        except ValueError:
            return None

    def close(self) -> None:
        """Kill the actors and remove the placement group; stop Ray if this pool started it."""
        import ray
        from ray.util import remove_placement_group

        if not ray.is_initialized():
            return
        self._shutdown_actors()
        for name in list(self._handles):
            self.kill(name)
        for name in self.roles if self.detached else ():  # actors other processes of the run created
            self.kill(name, named=True)
        remove_placement_group(self.pg)
        if self.started_ray:
            ray.shutdown()

    def _shutdown_actors(self) -> None:
        """Let the actors with something to finish do it before they are killed (``shutdown``): the vLLM engine
        actor stops its server (a failure leaves it to the actor's watchdog, ``ManagedServer.stop_with_parent``), a
        trainer finishes its background version and sharded state writes."""
        import ray

        refs = [(n, self._handles[n].shutdown.remote()) for n in list(self._handles)
                if hasattr(self.roles[n].cls, "shutdown")]
        for name, ref in refs:
            # a write takes what the storage takes (a call's bound); a server stops within a minute or is left
            writes = issubclass(self.roles[name].cls, actors.TrainerActor)
            try:
                ray.get(ref, timeout=self.pcfg.call_timeout_s if writes else 60.0)
            except Exception as e:  # noqa: BLE001 - the actor is killed next either way
                log.warning("pool %s: %s did not shut down cleanly (%s: %s)", self.prefix, name, type(e).__name__, e)

    # ----------------------------------------------------------------------------- the singleton

    @classmethod
    def get(cls, cfg) -> Pool:
        """The process's pool of this class (a compose run's is another) for ``cfg``: the config the actors were
        built from; another config closes the previous pool first. A run naming a pool (``pool.name``) gets its
        view of that long-lived pool (``tenants.NamedPool``: its tenants on the shared actors)."""
        key = config_key(cfg)
        if cls in _POOLS and not _ray_connected():
            del _POOLS[cls]  # Ray was shut down under it: its actors are gone
        if cls in _POOLS and _POOLS[cls].key == key:
            return _POOLS[cls]
        close_pool(cls)
        make: type[Pool] = cls
        if cls is Pool and cfg.pool.name is not None:
            if not NAMED_POOL:
                raise RuntimeError("pool.name: import unirl_core.pool.tenants (pool.phases does) before Pool.get")
            make = NAMED_POOL[0]
        _POOLS[cls] = make(cfg, key)
        return _POOLS[cls]


_POOLS: dict[type[Pool], Pool] = {}
NAMED_POOL: list[type[Pool]] = []
"""The Pool of a run that names a pool (``pool.name``): ``tenants.NamedPool``, registered when that module is
imported (``pool/phases.py`` imports it), so this module does not import it back."""


def close_pool(cls: type[Pool] = Pool) -> None:
    """Close the process's pool of class ``cls``, if any (idempotent)."""
    pool = _POOLS.pop(cls, None)
    if pool is not None:
        pool.close()


def current_pool() -> Pool | None:
    return _POOLS.get(Pool)


atexit.register(lambda: [close_pool(cls) for cls in reversed(list(_POOLS))])

