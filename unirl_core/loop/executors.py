"""The process's executors: the one place that reads ``pool.execution``.

A process keeps one executor per mode, made on first use; the phase functions (``loop.phases``), ``run_local``
and the Flyte tasks all reach the same instance, so what it holds (the resident trainer, the background writer)
carries from one phase to the next within the process, as a warm task pod or ``run_local`` needs.
"""

from __future__ import annotations

from unirl_core.config.run import RunConfig
from unirl_core.runtime.executor import Executor
from unirl_core.runtime.inprocess import InProcessExecutor

_PROCESS: dict[str, Executor] = {}


def executor_for(cfg: RunConfig) -> Executor:
    """This process's executor for ``cfg``'s execution mode: the Ray pool's, or in-process."""
    if cfg.pool.execution != "pool":
        return in_process()
    if "pool" not in _PROCESS:
        from unirl_core.pool.executor import PoolExecutor  # imports Ray on first use

        _PROCESS["pool"] = PoolExecutor()
    return _PROCESS["pool"]


def in_process() -> InProcessExecutor:
    """The process's in-process executor (eval, the tests' look at the resident trainer)."""
    ex = _PROCESS.get("in-process")
    if ex is None:
        ex = _PROCESS["in-process"] = InProcessExecutor()
    return ex


def finish_writes() -> None:
    """Wait for every version this process's executors are writing in the background; raise the first failure."""
    for ex in list(_PROCESS.values()):
        ex.finish_writes()
