"""The rollout manager: bounded, staleness-aware dispatch of rollout work, and a buffer of what came back.

One manager per driver (``run_local``, later the pool and agentic trainers). It is pure Python: work is
launched by a caller-given function that returns a ``concurrent.futures.Future`` (a thread pool's
``submit``, a Ray ``ObjectRef.future()``, or a future a test completes by hand), so nothing here knows
threads, processes or Ray.

Versions and steps. Training step ``n`` (1-based) trains from policy version ``n - 1`` and writes version
``n``. A rollout for step ``n`` sampled with version ``v`` is therefore ``(n - 1) - v`` versions stale when
it is trained. **Admission control**: step ``n`` is dispatched only when a version ``v >= n - 1 - lag`` is
published, with ``v`` chosen by ``version_policy``:

- ``pinned``: ``v = max(0, n - 1 - lag)``, independent of timing (reproducible runs; the Flyte DAG's
  dependency "rollout n waits for publication n - 1 - lag" is the same rule);
- ``latest``: the newest published version at dispatch (fresher, but which one depends on timing).

Either way no dispatched work can exceed ``max_policy_lag`` when trained, and at most ``max_inflight``
requests run at once. Completed results wait in a FIFO buffer (dispatch order) with their provenance
(the request: step, shard, the version that sampled it) until the trainer ``take``s its step.

``quiesce()`` pauses dispatch and drains in-flight work into the buffer (before a weight sync, an
evaluation or a checkpoint); ``resume()`` dispatches again. A failed resolve (the future raised) or route
(the result's recorded versions differ from the request's) *poisons* the manager: every later call
re-raises that original error, so lost samples are never reported as a clean state; only ``close()`` is
safe.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from unirl_core.errors import ConfigError, InvariantError, check_ints, field_error
from unirl_core.rollout.turn_gate import TurnGate

VersionPolicy = Literal["pinned", "latest"]


@dataclass(frozen=True, kw_only=True)
class RolloutRequest:
    """One unit of rollout work: a shard of a training step, sampled with one policy version."""

    step: int
    """The training step (1-based) whose batch this work feeds; that step trains from version ``step - 1``."""
    shard: int
    """Prompt shard of the step (0-based)."""
    policy_version: int
    """The published version that samples it (its provenance)."""

    @property
    def staleness(self) -> int:
        """Versions between the sampling policy and the one the step trains from."""
        return self.step - 1 - self.policy_version


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Bounds of the rollout manager."""

    max_policy_lag: int = 0
    """Largest ``trainer version - sampling version`` any dispatched work may have when trained (0: on-policy)."""
    max_inflight: int = 1
    """Requests running at once (rollout shards of one or more steps)."""
    num_shards: int = 1
    """Requests per step (``loop.rollout_shards``); a step is complete when all its shards are."""
    version_policy: VersionPolicy = "pinned"
    """``pinned``: step n samples with version ``max(0, n - 1 - lag)``; ``latest``: the newest published one."""
    last_step: int | None = None
    """The run's last step: nothing past it is dispatched (None: as far as the lag admits)."""

    def __post_init__(self) -> None:
        check_ints("manager", self, ("max_policy_lag",), "use e.g. 1", minimum=0)
        check_ints("manager", self, ("max_inflight", "num_shards"), "use e.g. 1")
        if self.last_step is not None and not (isinstance(self.last_step, int) and self.last_step >= 1):
            raise field_error(ConfigError, "manager.last_step", self.last_step, "None or an integer >= 1",
                              "pass loop.total_steps")
        if self.version_policy not in ("pinned", "latest"):
            raise field_error(ConfigError, "manager.version_policy", self.version_policy, "'pinned' or 'latest'",
                              "use 'pinned' for reproducible runs")


@dataclass
class Completed:
    """A finished request and its result, in the buffer until its step is taken."""

    request: RolloutRequest
    result: Any
    seconds: float
    """Wall time from dispatch to the completion being routed into the buffer."""


@dataclass
class StepRollout:
    """What ``take(step)`` returns: the step's results in shard order, with provenance and buffer metrics."""

    step: int
    results: list[Any]
    requests: list[RolloutRequest]
    wait_seconds: float
    """How long ``take`` blocked (the trainer's idle time waiting for rollouts)."""
    buffer_depth: int
    """Completed requests of later steps already buffered when this step was taken."""
    inflight: int
    """Requests still running when this step was taken."""

    def metrics(self, max_policy_lag: int = 0) -> dict[str, float]:
        """``async/*`` metrics; ``async/staleness_hist/<k>`` (k = 0..max_policy_lag, stable keys) is the share of
        the step's requests sampled k versions behind."""
        s = [r.staleness for r in self.requests]
        hist = {f"async/staleness_hist/{k}": sum(x == k for x in s) / len(s) for k in range(max_policy_lag + 1)}
        return {"async/staleness_mean": sum(s) / len(s), "async/staleness_max": float(max(s)), **hist,
                "async/buffer_depth": float(self.buffer_depth), "async/inflight": float(self.inflight),
                "async/rollout_wait_s": self.wait_seconds}


Launch = Callable[[RolloutRequest], "Future[Any]"]
Route = Callable[[RolloutRequest, Any], None]


class RolloutManager:
    """Dispatch rollout requests under ``ManagerConfig``'s bounds; buffer results until the trainer takes them.

    ``launch(request) -> Future``: starts the work (must not block on it). ``check(request, result)``: raises
    when the result does not belong to the request (e.g. its Parts record another policy version); the
    default accepts everything. Call ``publish(v)`` after every publication and ``take(step)`` for each step,
    in order. Not thread-safe for several drivers: one thread drives it, futures may complete on any.
    """

    def __init__(self, config: ManagerConfig, launch: Launch, *, check: Route | None = None,
                 first_step: int = 1, published: int = 0, gate: TurnGate | None = None) -> None:
        self.config = config
        self._gate = gate  # agentic work: quiesce parks it at turn boundaries instead of draining it
        self._launch = launch
        self._check = check
        self._published = published
        self._next_step = first_step  # next step to dispatch
        self._next_shard = 0
        self._next_take = first_step
        self._inflight: dict[Future, tuple[RolloutRequest, float]] = {}
        self._buffer: collections.OrderedDict[tuple[int, int], Completed] = collections.OrderedDict()
        self._done: collections.deque[Future] = collections.deque()
        self._cond = threading.Condition()
        self._paused = False
        self._closed = False
        self._error: BaseException | None = None
        self.dispatched: list[RolloutRequest] = []
        """Every request in dispatch order (provenance log; tests and metrics read it)."""

    # -- public ------------------------------------------------------------------------------
    @property
    def published(self) -> int:
        return self._published

    def publish(self, version: int) -> None:
        """Version ``version`` is available to engines; dispatch what it admits."""
        self._live()
        if version < self._published:
            raise field_error(InvariantError, "published version", version, f">= {self._published} (versions only "
                              "move forward)", "publish versions in training order")
        self._published = version
        self.pump()

    def pump(self) -> None:
        """Route finished work into the buffer, then dispatch while the bounds allow."""
        self._live()
        self._route_done()
        while not self._paused and self._admissible():
            self._dispatch()

    def take(self, step: int, *, timeout: float | None = None) -> StepRollout:
        """Block until every shard of ``step`` is complete and return them (removed from the buffer).

        Steps are taken in order; a step that was not dispatched yet is dispatched when admissible (and
        fails with InvariantError when it never can be: a version the trainer has not published)."""
        self._live()
        if step != self._next_take:
            raise field_error(InvariantError, "take(step)", step, f"step {self._next_take} (steps are taken in order)",
                              "take each step once, in training order")
        t0 = time.perf_counter()
        keys = [(step, s) for s in range(self.config.num_shards)]
        while True:
            self.pump()
            if all(k in self._buffer for k in keys):
                break
            stuck = self._paused or not self._admissible()
            if not self._inflight and stuck and any(k >= (self._next_step, self._next_shard) for k in keys):
                raise field_error(InvariantError, "take(step)", step, "a step whose rollout can be dispatched "
                                  f"(published version {self._published}, lag {self.config.max_policy_lag}"
                                  f"{', dispatch paused' if self._paused else ''})",
                                  "publish version step - 1 - max_policy_lag first, or resume() dispatch")
            self._wait(t0, timeout)
        done = [self._buffer.pop(k) for k in keys]
        self._next_take += 1
        wait = time.perf_counter() - t0
        out = StepRollout(step=step, results=[c.result for c in done], requests=[c.request for c in done],
                          wait_seconds=wait, buffer_depth=len(self._buffer), inflight=len(self._inflight))
        self.pump()  # a take frees nothing by itself, but routing may have admitted more
        return out

    def quiesce(self, *, timeout: float | None = None) -> int:
        """Pause dispatch and drain every in-flight request into the buffer; returns the buffered count.
        With a ``TurnGate``, in-flight agentic work parks at its next turn boundary instead (``turn_gate.py``)."""
        self._live()
        self._paused = True
        if self._gate is not None:
            self._gate.close()
        t0 = time.perf_counter()
        while True:
            self._route_done()
            self._live()
            if not self._inflight or (self._gate is not None and self._gate.all_parked()):
                return len(self._buffer)
            self._wait(t0, timeout, poll=None if self._gate is None else 0.05)  # parking completes no future

    def resume(self) -> None:
        """Dispatch again after ``quiesce``."""
        self._live()
        self._paused = False
        if self._gate is not None:
            self._gate.open()
        self.pump()

    @property
    def inflight(self) -> int:
        self._live()
        return len(self._inflight)

    @property
    def buffered(self) -> list[RolloutRequest]:
        """Provenance of the completed, not yet taken requests, in dispatch order."""
        self._live()
        return [c.request for c in self._buffer.values()]

    def close(self) -> None:
        """Stop dispatching and forget in-flight work (their futures are cancelled where possible). Always safe."""
        self._closed = True
        for fut in list(self._inflight):
            fut.cancel()
        self._inflight.clear()
        self._buffer.clear()

    # -- internals ---------------------------------------------------------------------------
    def _live(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise field_error(InvariantError, "rollout manager", "closed", "an open manager",
                              "build a new RolloutManager")

    def _version_for(self, step: int) -> int:
        if self.config.version_policy == "pinned":
            return max(0, step - 1 - self.config.max_policy_lag)
        return self._published

    def _admissible(self) -> bool:
        if len(self._inflight) >= self.config.max_inflight:
            return False
        step = self._next_step
        if self.config.last_step is not None and step > self.config.last_step:
            return False
        # dispatchable only once a version within the lag of step's trainer version (step - 1) is published
        need = max(0, step - 1 - self.config.max_policy_lag)
        if self._published < need:
            return False
        version = self._version_for(step)
        # holds by construction (pinned: version = need; latest: version = published >= need); kept as the check
        # the property test mutates
        return need <= version <= self._published

    def _dispatch(self) -> None:
        req = RolloutRequest(step=self._next_step, shard=self._next_shard,
                             policy_version=self._version_for(self._next_step))
        self._next_shard += 1
        if self._next_shard == self.config.num_shards:
            self._next_shard, self._next_step = 0, self._next_step + 1
        try:
            fut = self._launch(req)
        except BaseException as exc:
            self._poison(exc)
            raise
        self.dispatched.append(req)
        self._inflight[fut] = (req, time.perf_counter())
        fut.add_done_callback(self._on_done)

    def _on_done(self, fut: Future) -> None:
        with self._cond:
            self._done.append(fut)
            self._cond.notify_all()

    def _route_done(self) -> None:
        while True:
            with self._cond:
                if not self._done:
                    return
                fut = self._done.popleft()
            req, started = self._inflight.pop(fut)
            try:
                result = fut.result()  # resolve
                if self._check is not None:
                    self._check(req, result)  # route
            except BaseException as exc:
                self._poison(exc)
                raise
            self._buffer[(req.step, req.shard)] = Completed(request=req, result=result,
                                                            seconds=time.perf_counter() - started)

    def _wait(self, t0: float, timeout: float | None, poll: float | None = None) -> None:
        left = None if timeout is None else timeout - (time.perf_counter() - t0)
        if left is not None and left <= 0:
            raise TimeoutError(f"rollout manager: nothing completed within {timeout} s "
                               f"({len(self._inflight)} in flight)")
        if poll is not None:
            left = poll if left is None else min(left, poll)
        with self._cond:
            if not self._done:
                self._cond.wait(timeout=left)

    def _poison(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc


def check_batch_provenance(request: RolloutRequest, batch: Any) -> None:
    """Route check for SampleBatch results: every generated Part records the request's policy version."""
    versions = {p.policy_version for p in batch.generated}
    if versions != {request.policy_version}:
        raise field_error(InvariantError, f"rollout step {request.step} shard {request.shard}: part.policy_version",
                          sorted(versions), f"{{{request.policy_version}}} (the version it was dispatched with)",
                          "the engine sampled with other weights than the manager assigned; sync it to the "
                          "request's version before sampling")
