"""The trainer actor group (``pool.trainer_ranks`` > 1): one TrainerActor per rank, FSDP2 over a torch.distributed
group of their own, driven as one.

The group is opened after all ranks exist (rank 0's address and a free port, a token the driver draws: the ranks
rendezvous on a store prefixed by it, so a member of an older incarnation cannot join), and only then does each
rank build its TrainBackend (which shards with FSDP2, as under torchrun). Every train / state / checkpoint call
goes to every rank and is waited for as a whole (``wait_all``): the first failure of any rank ends the call, and
because the other ranks may be blocked in a collective with it, the whole group is killed; the next call
re-creates all ranks, re-opens the group and restores the version it trains from. With one rank the trainer is
the single actor ``trainer`` and none of this applies.
"""

from __future__ import annotations

import logging
import time
import uuid

from unirl_core.errors import PoolActorDied, TransientError

log = logging.getLogger(__name__)

TRAINER = "trainer"


def trainer_names(ranks: int) -> list[str]:
    """Actor names of the trainer ranks: ``trainer`` alone, else ``trainer-0`` .. ``trainer-<ranks-1>``."""
    return [TRAINER] if ranks == 1 else [f"{TRAINER}-{r}" for r in range(ranks)]


def names(pool) -> list[str]:
    if pool.pcfg.placement == "shared":  # the trainer is the shared actor (one rank)
        from unirl_core.pool.shared import SHARED

        return [SHARED]
    return trainer_names(pool.pcfg.trainer_ranks)


def rank0(pool) -> str:
    """The trainer rank that returns metrics, writes versions and sends the publish."""
    return names(pool)[0]


def ready(pool) -> bool:
    """True when every rank is alive in this process's view and all are in one open group (no actor created)."""
    ranks = names(pool)
    if len(ranks) == 1:
        return True
    if any(n not in pool.live for n in ranks):
        return False
    # attached: another task process may have re-opened the group
    tokens = {pool.remembered(n, "current_group", what="opening the trainer group", again=pool.detached)
              for n in ranks}
    return len(tokens) == 1 and None not in tokens


def ensure(pool) -> None:
    """Open the trainer group unless all ranks are alive in one group: otherwise kill every rank (a survivor's
    process group includes the lost rank), create all, and have them rendezvous and build their backends."""
    ranks = names(pool)
    if len(ranks) == 1 or ready(pool):
        return
    kill(pool)
    token = uuid.uuid4().hex
    addr, port = pool.call(ranks[0], "group_endpoint", what="opening the trainer group")
    calls = [(n, pool.remote(n, "join_group", token, addr, port, r, len(ranks))) for r, n in enumerate(ranks)]
    wait_all(pool, calls, what=f"opening the trainer group of {len(ranks)} ranks")
    for n in ranks:
        pool.memo(n)["current_group"] = token


def call(pool, method: str, *args, what: str):
    """``method(*args)`` on every trainer rank (after ``ensure``); returns rank 0's result."""
    ensure(pool)
    calls = [(n, pool.remote(n, method, *args)) for n in names(pool)]
    return wait_all(pool, calls, what=what)[0]


def kill(pool) -> None:
    """Kill every trainer rank (also those another process of the run created) and wait until their names are
    free, so the next call creates new ones."""
    ranks = names(pool)
    for n in ranks:
        pool.kill(n, named=True)
    deadline = time.monotonic() + 60.0
    for n in ranks:
        while pool.named(n) is not None and time.monotonic() < deadline:
            time.sleep(0.05)


def wait_all(pool, calls: list[tuple[str, object]], *, what: str) -> list:
    """Results of ``calls`` ((actor name, ObjectRef)) in order, waiting for whichever finishes first. The first
    failure ends the wait: a dead actor raises ``PoolActorDied`` naming it; when the failed call or any call still
    running is a trainer rank of a group, the whole group is killed first (its ranks may be blocked in a
    collective with the failed one). Bounded by ``pool.call_timeout_s`` as a whole."""
    import ray
    from ray.exceptions import RayActorError

    group = set(names(pool)) if pool.pcfg.trainer_ranks > 1 else set()
    pending = {ref: name for name, ref in calls}
    results: dict[object, object] = {}
    deadline = time.monotonic() + pool.pcfg.call_timeout_s
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            late = sorted(pending.values())
            for n in late:
                pool.kill(n)
            if group & set(late):
                kill(pool)
            raise TransientError(f"pool actors {late} of run {pool.cfg.name!r} did not finish {what} within "
                                 f"pool.call_timeout_s={pool.pcfg.call_timeout_s} s; they were killed and the next "
                                 "call re-creates them")
        ref = done[0]
        name = pending.pop(ref)
        try:
            results[ref] = ray.get(ref)
        except Exception as e:
            if isinstance(e, RayActorError):
                died = pool._died(name, e, what)
                if name in group:
                    died = PoolActorDied(f"{died} (the trainer group of {len(group)} ranks is re-created with it)")
            else:  # a peer's death explains a collective's error: name it
                died = _died_meanwhile(pool, pending, what)
            if group & ({name} | set(pending.values())):
                kill(pool)
            if died is None:
                raise
            raise died from e
    return [results[ref] for _, ref in calls]


DEATH_GRACE_S = 5.0
"""After a call of a collective fails, how long the others get to finish: a peer that died surfaces as
``PoolActorDied`` naming it rather than as the survivors' transport error."""


def _died_meanwhile(pool, pending: dict, what: str) -> PoolActorDied | None:
    import ray
    from ray.exceptions import RayActorError

    if not pending:
        return None
    done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=DEATH_GRACE_S)
    for ref in done:
        try:
            ray.get(ref)
        except RayActorError as e:
            return pool._died(pending[ref], e, what)
        except Exception as e:  # noqa: BLE001 - another failure of the same collective: the first one is raised
            log.info("pool: %s also failed during %s: %s", pending[ref], what, e)
    return None


def placements(pool) -> list[tuple]:
    """(node id, GPU ids) of every trainer rank (remembered per incarnation)."""
    ensure(pool)
    return [pool.remembered(n, "placement", what="publish") for n in names(pool)]


def holds(pool, ckpt) -> bool:
    """True when the trainer (every rank) holds version ``ckpt``; a group not open holds nothing (nothing is
    created to find that out)."""
    if not ready(pool):
        return False
    return bool(pool.call(rank0(pool), "holds", ckpt, what=f"publish v{ckpt.policy_version}"))

