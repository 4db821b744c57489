"""The process's RL executors (``runtime.executor.ProcessExecutors``): in-process, or the Ray pool's."""

from __future__ import annotations

from unirl_core.config.run import RunConfig
from unirl_core.runtime.executor import Executor, ProcessExecutors
from unirl_core.runtime.inprocess import InProcessExecutor


def _pool_executor() -> Executor:
    from unirl_core.pool.executor import PoolExecutor  # imports Ray on first use

    return PoolExecutor()


PROCESS: ProcessExecutors[Executor] = ProcessExecutors(InProcessExecutor, _pool_executor)
"""This process's RL executors."""


def executor_for(cfg: RunConfig) -> Executor:
    """This process's executor for ``cfg``'s execution mode: the Ray pool's, or in-process."""
    return PROCESS.for_run(cfg)


def in_process() -> InProcessExecutor:
    """The process's in-process executor (eval, lagged rollouts, the tests' look at the resident trainer)."""
    return PROCESS.in_process()


def finish_writes() -> None:
    """Wait for every version this process's executors are writing in the background; raise the first failure."""
    for ex in PROCESS.made():
        ex.finish_writes()
