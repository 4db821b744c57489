"""What every phase task shares: cache version, resources, decks, phase timing, the progress logger."""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import flytekit
from flytekit import Deck, Resources
from flytekit.core.context_manager import FlyteContextManager
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.extras.accelerators import H100, H200

import tasks.run_types  # noqa: F401  (registers RunConfig's transformer before any task signature is typed)
import tasks.types  # noqa: F401  (registers SampleBatch's transformer)
from unirl_core.errors import ConfigError, TransientError, field_error
from unirl_core.loop import resume

# Bump when a task's behaviour changes for the same inputs (new phase code that must not reuse old outputs).
CACHE_VERSION = "unirl-1"

ACCELERATOR_ENV = "UNIRL_ACCELERATOR"
ACCELERATORS = {"h100": H100, "h200": H200}


def _accelerator_from_env():
    # read at import, i.e. when the workflow is registered or packaged: the GPU kind belongs to the cluster
    name = os.environ.get(ACCELERATOR_ENV, "h200").lower()
    if name not in ACCELERATORS:
        raise field_error(ConfigError, ACCELERATOR_ENV, name, f"one of {sorted(ACCELERATORS)}",
                          "set it to the GPU kind of the cluster you register to")
    return ACCELERATORS[name]


DEFAULT_ACCELERATOR = _accelerator_from_env()

GPU_TASK = dict(requests=Resources(cpu="8", mem="64Gi", gpu="1"), limits=Resources(mem="96Gi", gpu="1"))
CPU_TASK = dict(requests=Resources(cpu="2", mem="8Gi"), limits=Resources(mem="16Gi"))

# Only our own decks: flytekit's default ones render every input/output with repr() (tensor reprs of whole
# batches) and run `pip list` in a subprocess, seconds per task on a small CPU box.
DECK = dict(enable_deck=True, deck_fields=())

ROLLOUT_TIMEOUT = timedelta(hours=2)
REWARD_TIMEOUT = timedelta(minutes=45)
TRAIN_TIMEOUT = timedelta(hours=4)
SMALL_TIMEOUT = timedelta(minutes=20)

# Failures worth a retry: timeouts, dropped connections and generic IO errors (a reward server restarting,
# S3 hiccups, a node going away). Missing files and library errors that mean "this input cannot work"
# (ConfigError, NumericsError, SchemaError, CheckpointError) are not.
TRANSIENT = (TimeoutError, ConnectionError)


def progress_logger() -> logging.Logger:
    """``unirl.progress``: one line per step at INFO, shown even when the root logger has no handler
    (``pyflyte run`` only configures flytekit's own logger)."""
    log = logging.getLogger("unirl.progress")
    if not any(getattr(h, "unirl_progress", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        h.unirl_progress = True
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def is_transient(e: BaseException) -> bool:
    """True for failures a retry can fix: IO errors and timeouts anywhere in the cause chain, and the library's
    ``TransientError`` (e.g. the reward client giving up after its own retries)."""
    seen = e
    while seen is not None:
        if isinstance(seen, (*TRANSIENT, TransientError)) or type(seen) is OSError:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextmanager
def phase(name: str, metrics_out: dict[str, float]) -> Iterator[None]:
    """Time the library call of a phase into ``metrics_out['time/<name>']`` and turn transient failures into
    ``FlyteRecoverableException`` so Flyte retries the task (remote runs; local runs do not retry)."""
    if _STOP_REQUESTED:  # a Ctrl-C flytekit's local runner swallowed: no phase starts after it
        _say_interrupted()
        raise RuntimeError(f"interrupted (Ctrl-C): the {name} phase was not started")
    t0 = time.perf_counter()
    try:
        yield
    except Exception as e:
        if is_transient(e):
            raise FlyteRecoverableException(f"{name}: transient failure, Flyte retries the task: {e}") from e
        raise
    metrics_out[f"time/{name}"] = time.perf_counter() - t0


def deck(name: str, html: str) -> None:
    """Add a deck to the running task (HTML fragments from unirl_core.report.phase_html)."""
    Deck(name, html)


def session_id() -> str:
    """Execution name (remote) - local executions all share the name ``local``."""
    return flytekit.current_context().execution_id.name


# flytekit's local runner gives every task a sandbox folder named after its parent's plus 8 random characters
# (``tempfile.mkdtemp(prefix=<parent folder>)``), and each chunk of a chained @dynamic runs inside the previous one:
# the name grows 8 characters a chunk and past ~28 chunks it is over the 255-character limit of a file name
# (``OSError: File name too long``). A local execution therefore chains at most this many chunks.
LOCAL_MAX_CHUNKS = 16


def local_execution() -> bool:
    """True inside a local execution (``pyflyte run`` without ``--remote``): its tasks run in this process."""
    state = FlyteContextManager.current_context().execution_state
    return state is not None and state.is_local_execution()


def chunk_steps(steps_per_chunk: int, total_steps: int) -> int:
    """Steps one chained chunk wires: ``steps_per_chunk`` (``loop.steps_per_chunk``) on a cluster; in a local
    execution at least ``ceil(total_steps / LOCAL_MAX_CHUNKS)``, so a long local run never nests its sandbox
    folders past the file-name limit. Chunking changes no step's work, only how the DAG is cut."""
    if not local_execution():
        return steps_per_chunk
    return max(steps_per_chunk, -(-total_steps // LOCAL_MAX_CHUNKS))


# The run a local `pyflyte run` trains (set by init_task): flytekit's SIGINT handler calls the registered
# handlers and then exits (SystemExit 1), so a Ctrl-C never reaches the tasks as a KeyboardInterrupt.
_INTERRUPTED_RUN: list = []
# Set by the first Ctrl-C of a local run. flytekit's local runner has been seen to swallow its SystemExit (the run
# went on); every phase checks this before it starts, so nothing is published after the message names LATEST.
_STOP_REQUESTED: list = []
GENERIC_RESUME = ("pyflyte run workflows/grpo.py grpo --recipe <recipe> --overrides '<the same overrides>' "
                  "--resume latest")


def say_resume_on_interrupt(cfg) -> None:
    """Local executions: on Ctrl-C, say (WARNING + stderr) which version of ``cfg``'s run was published last
    and the command that resumes it. Remote executions: nothing (Flyte owns a pod's signals)."""
    if not local_execution():
        return
    if not _INTERRUPTED_RUN:
        FlyteContextManager.add_signal_handler(_on_sigint)
    _INTERRUPTED_RUN[:] = [cfg]
    _STOP_REQUESTED.clear()  # a new run in this process starts uninterrupted


def _on_sigint(signum, frame) -> None:
    if _INTERRUPTED_RUN:
        _STOP_REQUESTED[:] = [True]
    _say_interrupted()


def _say_interrupted() -> None:
    if _INTERRUPTED_RUN:
        command = pyflyte_resume_command(sys.argv) or GENERIC_RESUME
        resume.tell(resume.interrupted_message(_INTERRUPTED_RUN[0], command))


def pyflyte_resume_command(argv: list[str], env: dict[str, str] | None = None) -> str | None:
    """The command that continues the local ``pyflyte run`` of ``argv``: the same line with ``--resume latest``
    (a fork's line stays as it is: run again, it continues the fork), after the thread variables of ``env``
    (default: this process's) that are set. None when ``argv`` is not a local ``pyflyte run``."""
    args = list(argv)
    if not args or "pyflyte" not in os.path.basename(args[0]) or "run" not in args or "--remote" in args:
        return None
    env = os.environ if env is None else env
    prefix = "".join(f"{k}={shlex.quote(env[k])} " for k in resume.THREAD_VARIABLES if env.get(k))
    if any(a == "--fork_as" or a.startswith("--fork_as=") for a in args):
        return prefix + shlex.join(args)
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            out.append(a)
    return prefix + shlex.join([*out, "--resume", "latest"])
