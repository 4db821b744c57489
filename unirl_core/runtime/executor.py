"""The executor interface: where a step's phases run and who holds the state between them.

The driver (``unirl_core.loop``) picks one executor per process and mode (``loop.executors.executor_for``) and
talks to it through these calls; no phase asks where it runs. Two implementations:

- ``runtime.inprocess.InProcessExecutor``: this process holds the rollout bundle, the trainer and the writer;
- ``pool.executor.PoolExecutor``: the run's Ray actors hold them; this process holds projections.

Synchronous RL is the same calls in order; asynchronous RL (``loop.lagged``) overlaps rollouts of lagged versions
with them, under a bound on policy lag (0: synchronous).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, Literal, Protocol, TypeVar

from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.run import RunConfig
from unirl_core.types import SampleBatch

Metrics = dict[str, float]


class Executor(Protocol):
    def rollout(self, cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int, num_shards: int,
                weights: Literal["policy", "ema"], gen_round: int = 0,
                trainer_copy: bool = False) -> tuple[SampleBatch, Metrics]:
        """Sample shard ``shard`` of step ``step`` with ``ckpt``'s (or its EMA) weights."""

    def score(self, cfg: RunConfig, batch: SampleBatch) -> tuple[SampleBatch, Metrics]:
        """Every sample scored (per component and weighted total)."""

    def advantage(self, cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef) -> tuple[SampleBatch, Metrics]:
        """Group-normalised advantages (with a tracker read from ``ckpt``)."""

    def train(self, cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *, step: int,
              asynchronous: bool = False) -> tuple[CheckpointRef, Metrics]:
        """One batch of updates from ``ckpt``; writes (unpublished) version ``step``."""

    def publish(self, cfg: RunConfig, ckpt: CheckpointRef, *, asynchronous: bool = False) -> dict:
        """Make ``ckpt`` the run's published version (and the engines' weights)."""

    def finish_writes(self) -> None:
        """Wait for any version being written in the background; raise its failure."""

    def rollout_workers(self, cfg: RunConfig) -> RolloutWorkers | None:
        """Workers of the executor's own that sample beside the driver and receive every published version (the
        pool's engine actors), started now; None when rollouts run in this process (lagged rollouts then sample on
        a thread of the driver's)."""


class RolloutWorkers(Protocol):
    call_timeout_s: float
    """The bound on one dispatched rollout (and on draining them)."""

    def submit(self, cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int,
               num_shards: int) -> Future:
        """Sample shard ``shard`` of step ``step`` with ``ckpt``: a Future of (batch, metrics)."""


T = TypeVar("T")


class ProcessExecutors(Generic[T]):
    """A process's executors of one kind of run: one per execution mode, made on first use. The one place that reads
    ``pool.execution``. Phase functions, ``run_local`` and the Flyte tasks of a process reach the same instance, so
    what it holds (the resident trainer, the background writer) carries from one phase to the next, as a warm task
    pod or ``run_local`` needs."""

    def __init__(self, in_process: Callable[[], T], pool: Callable[[], T]) -> None:
        self._make = {"in-process": in_process, "pool": pool}
        self._made: dict[str, T] = {}

    def _get(self, mode: str) -> T:
        if mode not in self._made:
            self._made[mode] = self._make[mode]()
        return self._made[mode]

    def for_run(self, cfg) -> T:
        """The executor for ``cfg``'s ``pool.execution``: the Ray pool's, or in-process."""
        return self._get("pool" if cfg.pool.execution == "pool" else "in-process")

    def in_process(self) -> T:
        """The in-process executor (eval samples with its bundles in every mode)."""
        return self._get("in-process")

    def made(self) -> list[T]:
        """The executors made so far."""
        return list(self._made.values())
