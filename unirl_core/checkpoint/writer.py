"""VersionWriter: one process's checkpoint versions written on a background thread while training goes on.

``save`` snapshots what the version holds (tensors that share memory with the trainer's live tensors are
copied: its next step changes them while the thread writes), hands ``CheckpointStore.save`` (payload files,
then the manifest, as always) to the writer's thread and returns the version's ref at once. ``publish`` asks that thread to move ``LATEST`` once the
manifest is written; retention runs there too. At most one version is in flight: the next ``save`` waits for
the previous one first. A write that failed raises ``CheckpointError`` naming the version at the next
``save`` / ``publish`` / ``wait`` of the same writer; a version after a failed one is never published.

What it does not change: a version exists only once its manifest parses, and ``LATEST`` names only such a
version (a process killed mid-write leaves the previous version published, the partial folder invisible).
What it does change: when ``publish`` returns, ``LATEST`` may still name the previous version for the
length of the write; readers of the store (another process, a resume) see the new version once it is done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from torch import Tensor
from torch.distributed.tensor import DTensor

from unirl_core.checkpoint.delta import WeightsMemory
from unirl_core.checkpoint.fsio import ProcessThreadPool
from unirl_core.checkpoint.ref import CheckpointRef
from unirl_core.checkpoint.store import CheckpointStore, load_manifest
from unirl_core.errors import CheckpointError, field_error
from unirl_core.checkpoint.host_staging import HostStaging, wait_all

log = logging.getLogger(__name__)


def snapshot(obj: object, live: set[int]) -> object:
    """``obj`` with fresh containers (dicts, lists, tuples). A CPU tensor is cloned when its storage is one of
    ``live`` (``storages(...)`` of what training goes on changing: a CPU trainer's parameters, AdamW's state
    including its CPU ``step`` counters on a GPU trainer); device tensors are copied to the host; other CPU
    tensors (host copies a state dict already made from the device) are kept as they are."""
    if isinstance(obj, Tensor):
        t = obj.detach()
        if t.device.type != "cpu":
            return t.to("cpu")
        return t.clone() if t.untyped_storage().data_ptr() in live else t
    if isinstance(obj, dict):
        return {k: snapshot(v, live) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v, live) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v, live) for v in obj)
    return obj


def storages(tensors: Iterable[Tensor]) -> set[int]:
    """The storage addresses of the CPU tensors among ``tensors`` (what ``snapshot`` compares against); a
    DTensor (FSDP2) counts by its local shard, whose memory a world-size-1 state dict may share."""
    out = set()
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.device.type == "cpu":
            out.add(t.untyped_storage().data_ptr())
    return out


class _Write:
    """One version's write (and, once asked, its publish), run by the writer's thread."""

    def __init__(self, store: CheckpointStore, ref: CheckpointRef, kwargs: dict[str, object],
                 ready: list, memory: WeightsMemory) -> None:
        self.store, self.ref, self.kwargs, self.ready, self.memory = store, ref, kwargs, ready, memory
        self.lock = threading.Lock()
        self.publish_requested = self.saved = False
        self.published = False
        self.files: dict[str, dict[str, object]] | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            wait_all(self.ready)  # the staged device->host copies have landed
            self.store.save(self.ref.step, policy_version=self.ref.policy_version, publish=False, memory=self.memory,
                            **self.kwargs)
            self.kwargs = {}  # the snapshot's memory goes now, not when the next version replaces this one
            self.files = load_manifest(self.ref, storage_options=self.store.storage_options).files
            with self.lock:
                self.saved = True
                publish = self.publish_requested
            if publish:
                self.store.publish(self.ref)
                self.published = True
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by VersionWriter.wait
            self.error = e
        finally:
            self.kwargs = {}
            self.seconds = time.perf_counter() - t0
            self.done.set()

    def request_publish(self) -> bool:
        """True when the thread will publish after its save; False when the save already finished."""
        with self.lock:
            if self.saved:
                return False
            self.publish_requested = True
            return True


class VersionWriter:
    """Background writer of a process's versions, in order, at most one in flight. Not thread-safe: one
    training thread calls it (the loop's train and publish phases)."""

    def __init__(self) -> None:
        # one long-lived thread: starting a thread per version costs the training thread up to ~10 ms on a busy
        # host (start() waits until the new thread runs); the executor finishes a queued write at interpreter exit
        self._pool = ProcessThreadPool(1, "unirl-checkpoint")
        self._write: _Write | None = None
        self._last: _Write | None = None
        self._chore: Future | None = None
        self.last_seconds = 0.0
        """Seconds the last finished write took on its thread (save, manifest read-back, publish)."""
        self.staging = HostStaging()
        """Pinned host buffers a caller may stage device tensors in before ``save`` (``save_train_checkpoint``
        does, for weights-only versions): reused version after version, so staged only after ``wait()``."""
        self.memory = WeightsMemory()
        """The last version this writer wrote (its thread's, or a synchronous save's given it): what a delta
        version (``checkpoint.weights_encoding: delta``) is encoded against."""

    def save(self, store: CheckpointStore, step: int, *, policy_version: int, live: Iterable[Tensor],
             **kwargs: object) -> CheckpointRef:
        """Start writing version ``step`` (``CheckpointStore.save`` keywords except ``publish``) and return its
        ref; ``live``: the tensors training goes on changing (snapshot tensors sharing memory with one are
        copied now). Waits for the previous write first and raises its failure."""
        self.wait()
        ref = store.ref_for(step, policy_version)
        shared = storages(live)
        data = {k: snapshot(v, shared) for k, v in kwargs.items()}
        self._write = _Write(store, ref, data, self.staging.fence(), self.memory)
        self._thread().submit(self._write.run)
        return ref

    def pending(self, ref: CheckpointRef) -> bool:
        """True while this writer is writing ``ref`` (or has written it and not been waited for)."""
        return self._write is not None and self._write.ref == ref

    def publish(self, ref: CheckpointRef) -> bool:
        """Have ``ref``'s write publish it once its manifest is written. False when ``ref`` is not this writer's
        write in flight (the caller publishes it); a finished write is waited for (its failure raised) and
        published here."""
        write = self._write
        if write is None or write.ref != ref:
            return False
        if write.request_publish():
            return True
        self.wait()
        write.store.publish(ref)
        return True

    def later(self, chore: Callable[[], object], what: str) -> None:
        """Run ``chore`` on the writer's thread after the writes queued so far (a version's retention, off the
        step's path). Best effort: a failure is logged (naming ``what``), not raised; ``wait_chores`` waits."""

        def run() -> None:
            try:
                chore()
            except Exception as e:  # noqa: BLE001 - a chore (retention) is retried by the next one
                log.warning("%s failed in the background: %s: %s", what, type(e).__name__, e)

        self._chore = self._thread().submit(run)

    def wait_chores(self) -> None:
        """Block until every chore queued so far (``later``) is done: the thread runs them in order, so the last."""
        chore, self._chore = self._chore, None
        if chore is not None:
            chore.result()

    def _thread(self) -> ThreadPoolExecutor:
        """The writer's one thread (writes and chores run on it in submission order), started on first use in
        each process (a forked child's writer has no thread: it starts its own)."""
        return self._pool.get()

    def last_written(self) -> tuple[CheckpointRef, dict[str, dict[str, object]]] | None:
        """(ref, manifest files) of the last write that ``wait`` saw succeed, else None."""
        write = self._last
        return (write.ref, write.files) if write is not None and write.files is not None else None

    def wait(self) -> None:
        """Block until the write in flight (and its publish) is done; raise CheckpointError naming the version
        when it failed (``LATEST`` then still names the version before it)."""
        write, self._write = self._write, None
        if write is None:
            return
        write.done.wait()
        self._last, self.last_seconds = write, write.seconds
        if write.error is not None:
            self._last = None
            what = "publishing" if write.saved else "writing"
            raise field_error(CheckpointError, write.ref.uri, f"{what} failed in the background: "
                              f"{type(write.error).__name__}: {write.error}", "a complete version",
                              f"the run's LATEST still names the version before step {write.ref.step} "
                              "(unless this was the publish); fix the storage and resume from LATEST") \
                from write.error
