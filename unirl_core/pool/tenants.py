"""A named, long-lived pool that many runs attach to (``pool.name``): one warm set of actor processes, one tenant
per run in each.

``NamedPool`` is the driver side: a ``Pool`` whose actors are tenants. Each role (``engine-0``, ``trainer-0``,
``reward-0``) is one detached host process named ``<pool.name>-<role>`` in the pool's detached placement group,
created by the first run that names the pool; a run's ``Pool.actor(role)`` is a handle to its own tenant there: an
``EngineActor`` / ``TrainerActor`` / ``RewardActor`` built from the run's config, keyed by the run's prefix
(``<run>-<config digest>``). So each run keeps its own adapter, optimizer state, version bookkeeping and scorers,
and its checkpoints stay under its own ``checkpoint.root`` / ``name``; the processes, their imports, the CUDA /
thread setup and the placement are shared and warm, and so is one resident copy of the frozen base: a new tenant's
frozen tensors are rebound to the bitwise-equal ones a tenant already holds (``pool/frozen.py``).

Scheduling: a host runs its tenants' calls on one thread, first come first served (Ray's actor queue); a
synchronous run has one call in flight per role, so N runs sharing the pool alternate phase by phase (round-robin
in effect). A tenant's numbers do not depend on its neighbours: its module, optimizer and seeded RNG streams are
its own (``tests/integration/test_pool_named.py`` checks every run bitwise against the same run alone).

``PoolRegistry`` (``<pool.name>-registry``, no resources) creates the placement group (one creator, however many
runs attach at once), records the attached runs and ends the pool after ``pool.idle_timeout_s`` without one.
Each host drops a tenant idle that long (its driver died) itself.

Access: the Ray cluster's token authentication (on by default in the pinned Ray) refuses a client without the
cluster's token before it reaches any actor; ``cluster.connect_error`` turns that refusal into a message naming the fix.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time

from unirl_core.errors import ConfigError, PoolActorDied, field_error
from unirl_core.pool import actors, cluster
from unirl_core.pool.cluster import NAMESPACE, Pool, close_pool
from unirl_core.pool.frozen import FrozenShare, held_bytes, release_freed, rss_bytes

log = logging.getLogger(__name__)

REGISTRY = "registry"
WATCH_S = 1.0
"""How often a host and the registry look for idle tenants / an idle pool."""


class TenantHost:
    """One role's process of a named pool: hosts one instance of the role's class per attached run."""

    def __init__(self, pool_name: str, role: str, idle_timeout_s: float) -> None:
        self.pool_name, self.role, self.idle_timeout_s = pool_name, role, idle_timeout_s
        self.tenants: dict[str, object] = {}
        self.last_call: dict[str, float] = {}
        self.busy: dict[str, int] = {}
        self.lock = threading.Lock()
        self.frozen = FrozenShare()  # one resident copy of the tenants' equal frozen tensors
        threading.Thread(target=self._watch, name="tenant-idle", daemon=True).start()

    def attach(self, tenant: str, cls: type, cfg, threads: int) -> bool:
        """Build run ``tenant``'s instance of ``cls`` from its config (once), its frozen tensors rebound to the
        bitwise-equal ones other tenants hold (``FrozenShare``); True when it was built now."""
        with self.lock:
            if tenant in self.tenants:
                return False
        obj = cls(cfg, self.role, threads)
        stats = self.frozen.share(obj.frozen_modules())
        release_freed()
        with self.lock:
            self.tenants.setdefault(tenant, obj)
            self.last_call[tenant] = time.monotonic()
        log.info("pool %s: %s attached run %s (%d tenants; %d of its %d frozen tensors shared, %.1f MB)",
                 self.pool_name, self.role, tenant, len(self.tenants), stats.shared, stats.frozen,
                 stats.shared_bytes / 1e6)
        return True

    def _tenant(self, tenant: str):
        with self.lock:
            obj = self.tenants.get(tenant)
            if obj is not None:
                self.busy[tenant] = self.busy.get(tenant, 0) + 1
        if obj is None:
            raise PoolActorDied(f"run {tenant!r} holds no tenant on {self.pool_name}-{self.role} (dropped after "
                                f"pool.idle_timeout_s={self.idle_timeout_s} s idle, or detached); the next call "
                                "attaches it again from the last published version")
        return obj

    def _done(self, tenant: str) -> None:
        with self.lock:
            self.busy[tenant] -= 1
            self.last_call[tenant] = time.monotonic()

    def call(self, tenant: str, method: str, *args):
        """``method(*args)`` of run ``tenant``'s instance, in the default group (one at a time, in arrival order);
        raises when it wrote into a frozen tensor other tenants share (``FrozenShare.check``), also when it failed
        (the write is then named before the call's own error, which is chained to it)."""
        where = f"{self.pool_name}-{self.role}: {method} of run {tenant!r}"
        try:
            out = self._invoke(tenant, method, args)
        except BaseException:
            self.frozen.check(where, self._holds(tenant))
            raise
        self.frozen.check(where, self._holds(tenant))
        return out

    def _holds(self, tenant: str):
        """Whether run ``tenant``'s frozen modules reference a tensor's storage (asked only once a shared tensor
        was written): a tenant of another base keeps running."""
        def holds(t: torch.Tensor) -> bool:
            obj = self.tenants.get(tenant)
            if obj is None:
                return False
            ptr = t.untyped_storage().data_ptr()
            return any(x.untyped_storage().data_ptr() == ptr for m in obj.frozen_modules().values()
                       for x in (*m.parameters(), *m.buffers()))
        return holds

    def query(self, tenant: str, method: str, *args):
        """``method(*args)`` in the query group (``actors.QUERIES``: bookkeeping beside a running call)."""
        return self._invoke(tenant, method, args)

    def _invoke(self, tenant: str, method: str, args: tuple):
        obj = self._tenant(tenant)
        try:
            return getattr(obj, method)(*args)
        finally:
            self._done(tenant)

    def memory(self) -> dict[str, int]:
        """What this host holds: tenants, frozen tensors a tenant was rebound to, the bytes of the distinct
        storages of all tenants' parameters and buffers (``param_bytes``), the sum of each tenant's own count
        (``param_bytes_unshared``: what the tenants would hold without sharing), the process's resident set size."""
        with self.lock:
            objs = list(self.tenants.values())
        per_tenant = [list(obj.frozen_modules().values()) for obj in objs]
        return {"tenants": len(objs), "shared_tensors": self.frozen.shared_count(),
                "param_bytes": held_bytes([m for mods in per_tenant for m in mods]),
                "param_bytes_unshared": sum(held_bytes(mods) for mods in per_tenant), "rss_bytes": rss_bytes()}

    def tenant_names(self) -> list[str]:
        with self.lock:
            return sorted(self.tenants)

    def drop(self, tenant: str) -> bool:
        """Forget run ``tenant`` (after its ``shutdown``, when it has one); False when it held none."""
        with self.lock:
            obj = self.tenants.pop(tenant, None)
            self.last_call.pop(tenant, None)
            self.busy.pop(tenant, None)
        if obj is None:
            return False
        shutdown = getattr(obj, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception as e:  # noqa: BLE001 - dropped either way; its versions are manifest-last
                log.warning("pool %s: %s of run %s did not shut down cleanly (%s)", self.pool_name, self.role,
                            tenant, e)
        return True

    def pid(self) -> int:
        return os.getpid()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_S)
            now = time.monotonic()
            with self.lock:
                idle = [t for t, last in self.last_call.items()
                        if not self.busy.get(t) and now - last > self.idle_timeout_s]
            for tenant in idle:
                log.warning("pool %s: dropping run %s from %s (idle > %s s)", self.pool_name, tenant, self.role,
                            self.idle_timeout_s)
                self.drop(tenant)


class PoolRegistry:
    """The named pool's bookkeeping actor: creates its placement group once, records attached runs, and removes
    the pool (placement group, hosts, itself) after ``idle_timeout_s`` with no tenant on any host."""

    def __init__(self, pool_name: str, idle_timeout_s: float) -> None:
        self.pool_name, self.idle_timeout_s = pool_name, idle_timeout_s
        self.runs: dict[str, float] = {}  # run prefix -> attach time
        self.hosts: set[str] = set()
        self.last_active = time.monotonic()
        self.created = time.time()
        self.pg = None
        threading.Thread(target=self._watch, name="pool-idle", daemon=True).start()

    def placement_group(self, bundles: list[dict[str, float]], strategy: str, timeout_s: float):
        """The pool's placement group, reserved now unless it exists (placement group names are per Ray namespace:
        the registry's, so every run's driver finds the same); None when it was not ready in time (then removed)."""
        import ray
        from ray.util import placement_group, remove_placement_group

        if self.pg is not None:
            return self.pg
        pg = placement_group(bundles, strategy=strategy, name=f"{self.pool_name}-pg", lifetime="detached")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            return None
        self.pg = pg
        return pg

    def attach(self, run: str, hosts: list[str]) -> dict:
        """Record run ``run`` (a prefix) and the hosts it uses; returns what the pool reports about itself."""
        self.runs.setdefault(run, time.time())
        self.hosts.update(hosts)
        self.last_active = time.monotonic()
        return {"pool": self.pool_name, "runs": len(self.runs), "created": self.created}

    def detach(self, run: str) -> None:
        """Forget run ``run`` (its driver dropped its tenants)."""
        self.runs.pop(run, None)
        self.last_active = time.monotonic()

    def attached(self) -> list[str]:
        return sorted(self.runs)

    def _tenants(self) -> set[str]:
        import ray

        out: set[str] = set()
        for host in list(self.hosts):
            try:
                out.update(ray.get(ray.get_actor(f"{self.pool_name}-{host}", namespace=NAMESPACE)
                                   .tenant_names.options(concurrency_group=actors.QUERY_GROUP).remote(), timeout=30))
            except Exception:  # noqa: BLE001 - a dead host holds no tenant
                pass
        return out

    def _watch(self) -> None:
        """The pool is idle when no host holds a tenant and no run has attached for ``idle_timeout_s``; a run whose
        tenants are all gone (detached, or dropped by the hosts after its driver died) for that long is forgotten."""
        gone: dict[str, float] = {}  # run -> since when it holds no tenant
        while True:
            time.sleep(WATCH_S)
            if not self.hosts:
                continue
            live, now = self._tenants(), time.monotonic()
            for run in list(self.runs):
                if run in live:
                    gone.pop(run, None)
                elif now - gone.setdefault(run, now) > self.idle_timeout_s:
                    self.runs.pop(run, None)
                    gone.pop(run, None)
            if live or self.runs:
                self.last_active = now
            elif now - self.last_active > self.idle_timeout_s:
                self._teardown()

    def _teardown(self) -> None:
        import ray
        from ray.util import remove_placement_group

        log.warning("pool %s: no run attached for %s s; removing it", self.pool_name, self.idle_timeout_s)
        for host in self.hosts:
            try:
                ray.kill(ray.get_actor(f"{self.pool_name}-{host}", namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass
        if self.pg is not None:
            remove_placement_group(self.pg)
        os._exit(0)  # a detached actor ends itself; its name is free for the next pool of this name


class _TenantMethod:
    """``handle.method`` of a tenant: ``.remote(*args)`` and ``.options(concurrency_group=...)`` as a Ray actor
    method has, routed to the host with the run's tenant key."""

    def __init__(self, host, tenant: str, method: str, group: str | None = None) -> None:
        self.host, self.tenant, self.method, self.group = host, tenant, method, group

    def options(self, *, concurrency_group: str | None = None) -> _TenantMethod:
        return _TenantMethod(self.host, self.tenant, self.method, concurrency_group)

    def remote(self, *args):
        if self.group == actors.QUERY_GROUP or self.method in actors.QUERIES:
            return self.host.query.options(concurrency_group=actors.QUERY_GROUP).remote(self.tenant, self.method,
                                                                                        *args)
        return self.host.call.remote(self.tenant, self.method, *args)


class TenantHandle:
    """A run's handle to its tenant on a host: ``handle.method.remote(*args)`` like an actor handle."""

    def __init__(self, host, tenant: str) -> None:
        self.host, self.tenant = host, tenant

    def __getattr__(self, method: str) -> _TenantMethod:
        if method.startswith("__"):
            raise AttributeError(method)
        return _TenantMethod(self.host, self.tenant, method)


class NamedPool(Pool):
    """A run's view of the named pool ``pool.name``: the shared hosts, the run's tenants on them."""

    def __init__(self, cfg, key: str) -> None:
        self.pool_name = cfg.pool.name
        super().__init__(cfg, key)
        self.detached = True
        self.hosts: dict[str, object] = {}
        self.info = self.call_registry("attach", self.prefix, sorted(self.roles), what="attaching")
        # detach at exit while Ray is still connected (its own exit hook, registered at ray.init, runs after this)
        atexit.register(close_pool)
        log.info("run %s attached to pool %s (%d runs)", self.prefix, self.pool_name, self.info["runs"])

    # ----------------------------------------------------------------------------- the shared part

    def registry(self):
        """The pool's registry actor (created by the first run that names the pool)."""
        if getattr(self, "_registry", None) is not None:
            return self._registry
        import ray

        self._registry = ray.remote(num_cpus=0, concurrency_groups={actors.QUERY_GROUP: 1})(PoolRegistry).options(
            name=f"{self.pool_name}-{REGISTRY}", namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
            max_restarts=0).remote(self.pool_name, self.pcfg.idle_timeout_s)
        return self._registry

    def call_registry(self, method: str, *args, what: str):
        import ray

        return ray.get(getattr(self.registry(), method).remote(*args), timeout=self.pcfg.call_timeout_s)

    def _placement_group(self):
        """The pool's placement group from its registry: reserved by the first run (its resources hold for all)."""
        import ray

        bundles = self._bundles()
        self._check_fits(bundles)
        pg = self.call_registry("placement_group", bundles, self.strategy, self.pcfg.placement_timeout_s,
                                what="reserving the placement group")
        if pg is None:
            raise field_error(ConfigError, "pool.placement_timeout_s", self.pcfg.placement_timeout_s,
                              f"time to reserve {bundles} ({self.pcfg.placement}) for pool {self.pool_name!r}; the "
                              f"cluster has {ray.available_resources()} free now", "free the cluster's resources, "
                              "lower pool.*.num_cpus / num_gpus, or raise the timeout")
        return pg

    def host(self, name: str):
        """The live host process of role ``name`` (created in the pool's placement group on first use)."""
        if name in self.hosts:
            return self.hosts[name]
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = self.roles[name].resources
        remote = ray.remote(concurrency_groups={actors.QUERY_GROUP: 1})(TenantHost)
        host = remote.options(
            name=f"{self.pool_name}-{name}", namespace=NAMESPACE, get_if_exists=True, max_restarts=0,
            lifetime="detached", num_cpus=res.num_cpus, num_gpus=res.num_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=self.bundle_of[name]),
        ).remote(self.pool_name, name, self.pcfg.idle_timeout_s)
        self.hosts[name] = host
        return host

    # ----------------------------------------------------------------------------- the run's tenants

    def actor(self, name: str):
        if name in self._handles:
            return self._handles[name]
        host = self.host(name)
        # queued before the run's first call on this host (Ray keeps one caller's calls in order)
        host.attach.remote(self.prefix, self.roles[name].cls, self.actor_config(name),
                           max(1, int(self.roles[name].resources.num_cpus)))
        handle = TenantHandle(host, self.prefix)
        self._handles[name] = handle
        self._memo.pop(name, None)
        return handle

    def _died(self, name: str, error: BaseException, what: str):
        died = super()._died(name, error, what)
        if died is not None:
            self.hosts.pop(name, None)  # the host process itself is gone (every tenant with it)
            return died
        from ray.exceptions import RayTaskError

        if isinstance(error, RayTaskError) and isinstance(error.cause, PoolActorDied):  # the tenant was dropped
            self._handles.pop(name, None)
            self._memo.pop(name, None)
            return PoolActorDied(str(error.cause))
        return None

    def wait(self, name: str, ref, *, what: str):
        from ray.exceptions import RayTaskError

        try:
            return super().wait(name, ref, what=what)
        except RayTaskError as e:
            died = self._died(name, e, what)
            if died is not None:
                raise died from e
            raise

    def kill(self, name: str, *, named: bool = False) -> None:
        """Drop this run's tenant on host ``name`` (the host and the other runs' tenants stay)."""
        import ray

        self._handles.pop(name, None)
        self._memo.pop(name, None)
        host = self.hosts.get(name) or self._named_host(name)
        if host is not None:
            try:
                ray.get(host.drop.remote(self.prefix), timeout=self.pcfg.call_timeout_s)
            except Exception as e:  # noqa: BLE001 - a dead host holds no tenant
                log.warning("pool %s: dropping %s of run %s: %s", self.pool_name, name, self.prefix, e)

    def _named_host(self, name: str):
        import ray

        try:
            return ray.get_actor(f"{self.pool_name}-{name}", namespace=NAMESPACE)
        except ValueError:
            return None

    def named(self, name: str):
        host = self._named_host(name)
        return None if host is None else TenantHandle(host, self.prefix)

    def close(self) -> None:
        """Detach the run: its tenants finish their writes and are dropped; the hosts and the placement group stay
        for the other runs (the registry ends them after ``pool.idle_timeout_s`` without a run)."""
        import ray

        if not ray.is_initialized():
            return
        self._shutdown_actors()
        for name in list(self._handles):
            self.kill(name)
        try:
            self.call_registry("detach", self.prefix, what="detaching")
        except Exception as e:  # noqa: BLE001 - the registry ends the pool on its own
            log.warning("pool %s: detaching run %s: %s", self.pool_name, self.prefix, e)
        if self.started_ray:
            ray.shutdown()


cluster.NAMED_POOL.append(NamedPool)  # Pool.get builds it for a run that names a pool
