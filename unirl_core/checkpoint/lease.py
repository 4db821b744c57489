"""One writer per run: a lease file ``<root>/<run>/LEASE`` that a run's writer takes before it writes a version.

A second execution of the same run (an overlapping scheduled execution, a second ``run_local``) finds the lease held
and refuses, naming the holder and the fix, or waits for it (``checkpoint.lease.on_held``). A lease whose holder is
gone is taken over with a WARNING: a holder on this host whose process is dead, or any holder whose heartbeat is
older than ``ttl_s``.

The file is one JSON record (holder host, pid, Flyte execution id when there is one, start time, heartbeat,
expiry, a random token). Every change is a compare-and-swap, so two writers racing for a free or stale lease
cannot both win:

- local directory: the read-decide-replace runs under an ``fcntl.flock`` of ``<run>/.LEASE.lock``; the record is
  written to a temp file and ``os.replace``d;
- S3 (s3fs): a free run is claimed with a conditional PUT (``If-None-Match: *``), a held record is replaced with
  ``If-Match: <etag of the record read>``; the loser gets HTTP 412 and reads again;
- any other fsspec filesystem: write then read back (not atomic; a WARNING says so once).

Release does not delete the file: it writes a released record (a conditional delete is not in every S3 API), which
the next writer takes like a stale one, without a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from unirl_core.errors import CheckpointError, ConfigError, field_error

log = logging.getLogger(__name__)

LEASE_FILE = "LEASE"
EXECUTION_ENV = ("FLYTE_INTERNAL_EXECUTION_PROJECT", "FLYTE_INTERNAL_EXECUTION_DOMAIN", "FLYTE_INTERNAL_EXECUTION_ID")
"""The variables Flyte sets in every task pod of an execution: together, the execution's id."""


class LeaseHeld(CheckpointError):
    """Another live writer holds the run's lease."""


class LeaseLost(CheckpointError):
    """This writer's lease was taken over (its heartbeat expired): it must not publish into the run."""


@dataclass(frozen=True, kw_only=True)
class LeaseConfig:
    """The run's single-writer lease (``unirl_core/checkpoint/lease.py``)."""

    on_held: Literal["refuse", "wait"] = "refuse"
    """When another live execution holds the run: ``refuse`` raises at once, naming the holder; ``wait`` polls
    until it is released or goes stale (at most ``wait_s``), e.g. for scheduled runs that may overlap."""
    wait_s: float = 3600.0
    """``wait``: the longest wait before refusing anyway."""
    ttl_s: float = 1800.0
    """Seconds after its last heartbeat that a lease counts as stale and may be taken over. ``run_local`` renews
    it every ``ttl_s / 3`` from a thread; a Flyte execution renews it in the init task and each publish task, so
    it must exceed the longest step."""

    def __post_init__(self) -> None:
        if self.on_held not in ("refuse", "wait"):
            raise field_error(ConfigError, "checkpoint.lease.on_held", self.on_held, "'refuse' or 'wait'",
                              "pick one")
        for name in ("wait_s", "ttl_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise field_error(ConfigError, f"checkpoint.lease.{name}", v, "a number of seconds > 0",
                                  "use e.g. 1800")


@dataclass(frozen=True, kw_only=True)
class Holder:
    """Who writes the run: a host and process, and the Flyte execution when the process is a task pod."""

    host: str
    pid: int
    execution: str | None = None
    started: float = 0.0

    @classmethod
    def current(cls) -> Holder:
        parts = [os.environ.get(k) for k in EXECUTION_ENV]
        execution = ":".join(p for p in parts if p) if parts[-1] else None
        return cls(host=socket.gethostname(), pid=os.getpid(), execution=execution, started=time.time())

    def same_writer(self, other: Holder) -> bool:
        """One execution's tasks run in several pods: the execution id decides when there is one."""
        if self.execution or other.execution:
            return self.execution == other.execution
        return (self.host, self.pid) == (other.host, other.pid)

    def describe(self) -> str:
        who = f"Flyte execution {self.execution} (last on host {self.host}, pid {self.pid})" if self.execution \
            else f"pid {self.pid} on host {self.host}"
        return f"{who}, started {_utc(self.started)}"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass(frozen=True, kw_only=True)
class Record:
    holder: Holder
    token: str
    heartbeat: float
    expires: float
    released: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Record | None:
        try:
            d = json.loads(data)
            return cls(holder=Holder(**d["holder"]), token=d["token"], heartbeat=float(d["heartbeat"]),
                       expires=float(d["expires"]), released=bool(d.get("released", False)))
        except (ValueError, KeyError, TypeError):
            return None  # a torn or foreign file: treated as free (a warning says so)

    def stale_reason(self, now: float) -> str | None:
        """Why the record no longer holds the run (None: it does)."""
        if self.released:
            return "released"
        if now > self.expires:
            return f"its heartbeat is {now - self.heartbeat:.0f} s old (expired {_utc(self.expires)})"
        if self.holder.host == socket.gethostname() and not self.holder.execution and not _alive(self.holder.pid):
            return f"process {self.holder.pid} on this host is dead"
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM  # exists, another user's
    return True


class _Conflict(Exception):
    """The record changed between read and write (another writer won the race): read again."""


class _File:
    """The lease file on one filesystem: ``read() -> (bytes | None, version)``, ``swap(data, version)`` that
    raises ``_Conflict`` unless the file is still at ``version``."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        self.local = isinstance(fs, LocalFileSystem)
        self.s3 = "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        if not self.local:
            yield
            return
        import fcntl  # noqa: PLC0415 (POSIX only; object stores need none)
        folder = os.path.dirname(self.path)
        for attempt in range(3):
            os.makedirs(folder, exist_ok=True)
            try:
                fd = os.open(os.path.join(folder, "." + LEASE_FILE + ".lock"), os.O_RDWR | os.O_CREAT)
                break
            except FileNotFoundError:  # the empty run folder was removed meanwhile (another process's preflight
                if attempt == 2:       # probe of the same run): made again
                    raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    def read(self) -> tuple[bytes | None, str | None]:
        try:
            if self.s3:
                self.fs.invalidate_cache(self.path)
                etag = self.fs.info(self.path)["ETag"]
                return self.fs.cat_file(self.path), etag
            return self.fs.cat_file(self.path), None
        except FileNotFoundError:
            return None, None

    def swap(self, data: bytes, exists: bool, etag: str | None) -> None:
        if self.local:  # under the flock: nobody else reads or writes now
            tmp = f"{self.path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            return
        if self.s3:
            try:
                if exists:
                    # unquoted: Ceph RGW compares the bare hex and refuses the quoted form HEAD returns
                    self.fs.pipe_file(self.path, data, IfMatch=(etag or "").strip('"'))
                else:
                    self.fs.pipe_file(self.path, data, mode="create")
            except Exception as e:  # s3fs maps HTTP 412 (and RGW's 409 for a racing create) to OSError variants
                if _precondition_failed(e):
                    raise _Conflict() from e
                raise
            finally:
                self.fs.invalidate_cache(self.path)
            return
        _warn_not_atomic(self.fs)
        self.fs.pipe_file(self.path, data)
        if self.fs.cat_file(self.path) != data:
            raise _Conflict()


def _precondition_failed(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e} {e.__cause__!r}"
    return any(s in text for s in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"))


_warned: set[str] = set()


def _warn_not_atomic(fs: fsspec.AbstractFileSystem) -> None:
    name = type(fs).__name__
    if name not in _warned:
        _warned.add(name)
        log.warning("run lease on %s: no atomic compare-and-swap on this filesystem; two writers starting within "
                    "the same instant could both take it (local directories and S3 are atomic)", name)


class RunLease:
    """The lease of run ``run`` under store root ``root`` (an fsspec URL), held by this process's ``Holder``."""

    def __init__(self, root: str, run: str, config: LeaseConfig | None = None, *,
                 storage_options: dict[str, object] | None = None, holder: Holder | None = None) -> None:
        self.config = config or LeaseConfig()
        fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
        self._file = _File(fs, posixpath.join(path, run, LEASE_FILE))
        self.uri = self._file.path if self._file.local else fs.unstrip_protocol(self._file.path)
        self.holder = holder or Holder.current()
        self.run = run
        self._token: str | None = None
        self._lost: LeaseLost | None = None

    def _record(self, token: str, started: float) -> Record:
        now = time.time()
        return Record(holder=dataclasses.replace(self.holder, started=started), token=token, heartbeat=now,
                      expires=now + self.config.ttl_s)

    def try_acquire(self) -> Record | None:
        """Take the lease (or renew it when this writer holds it); returns the live record of another holder
        when that one holds it instead."""
        while True:
            with self._file.locked():
                data, etag = self._file.read()
                current = Record.from_bytes(data) if data is not None else None
                if data is not None and current is None:
                    log.warning("run lease %s: unreadable record %r; taking it", self.uri, data[:80])
                if current is not None and not current.released:
                    reason = current.stale_reason(time.time())
                    if reason is None and not current.holder.same_writer(self.holder):
                        return current
                    if reason is not None and not current.holder.same_writer(self.holder):
                        log.warning("run lease %s: taking over from %s: %s", self.uri, current.holder.describe(),
                                    reason)
                mine = current is not None and current.holder.same_writer(self.holder) and not current.released
                record = self._record(current.token if mine else uuid.uuid4().hex,
                                      current.holder.started if mine else self.holder.started)
                try:
                    self._file.swap(record.to_bytes(), data is not None, etag)
                except _Conflict:
                    continue
            self._token = record.token
            log.info("run lease %s held by %s until %s", self.uri, record.holder.describe(), _utc(record.expires))
            return None

    def acquire(self) -> None:
        """Take the lease per ``config.on_held``: raise ``LeaseHeld`` naming the holder, or wait for it."""
        deadline = time.monotonic() + self.config.wait_s
        poll = min(5.0, self.config.ttl_s / 10)
        told = False
        while (other := self.try_acquire()) is not None:
            if self.config.on_held == "refuse" or time.monotonic() >= deadline:
                raise self._held_error(other)
            if not told:
                log.warning("run lease %s is held by %s; waiting (at most %.0f s) for it to finish or go stale",
                            self.uri, other.holder.describe(), self.config.wait_s)
                told = True
            time.sleep(poll)

    def _held_error(self, other: Record) -> LeaseHeld:
        waited = " (waited checkpoint.lease.wait_s)" if self.config.on_held == "wait" else ""
        return LeaseHeld(
            f"run {self.run!r} is being written by {other.holder.describe()}; its lease {self.uri} expires "
            f"{_utc(other.expires)} unless renewed{waited}. Fix: wait for that execution to finish (or set "
            "checkpoint.lease.on_held=wait), write another run (name=...), or, if that writer is really gone, "
            f"delete {self.uri} (it goes stale by itself after checkpoint.lease.ttl_s without a heartbeat)")

    def renew(self) -> None:
        """Refresh the heartbeat; ``LeaseLost`` when another writer holds the run now."""
        other = self.try_acquire()
        if other is not None:
            raise LeaseLost(f"run {self.run!r}: the lease {self.uri} was taken over by {other.holder.describe()} "
                            f"(this writer's heartbeat went past checkpoint.lease.ttl_s="
                            f"{self.config.ttl_s:g}); this writer stops so the two never publish into one run. "
                            "Raise checkpoint.lease.ttl_s above the longest step")

    def release(self) -> None:
        """Mark the lease released (only when this writer still holds it)."""
        while True:
            with self._file.locked():
                data, etag = self._file.read()
                current = Record.from_bytes(data) if data is not None else None
                if current is None or current.released or not current.holder.same_writer(self.holder):
                    return
                try:
                    self._file.swap(dataclasses.replace(current, released=True).to_bytes(), True, etag)
                except _Conflict:
                    continue
            log.info("run lease %s released", self.uri)
            return

    def holder_record(self) -> Record | None:
        """The record on file (None: no lease was ever written)."""
        data, _ = self._file.read()
        return Record.from_bytes(data) if data is not None else None

    def check(self) -> None:
        """Raise the ``LeaseLost`` the heartbeat thread of ``kept`` met, if any (the driver calls it between
        steps: the thread cannot stop the step in flight)."""
        if self._lost is not None:
            raise self._lost

    @contextlib.contextmanager
    def kept(self) -> Iterator[RunLease]:
        """Acquire, renew every ``ttl_s / 3`` from a daemon thread, release at the end (also on error)."""
        self.acquire()
        stop = threading.Event()
        self._lost = None

        def beat() -> None:
            while not stop.wait(self.config.ttl_s / 3):
                try:
                    self.renew()
                except LeaseLost as e:
                    self._lost = e
                    log.error("%s", e)
                    return
                except Exception as e:  # a storage hiccup: the next beat tries again before the lease expires
                    log.warning("run lease %s: heartbeat failed (%s); retrying", self.uri, e)

        thread = threading.Thread(target=beat, name="unirl-run-lease", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            if self._lost is None:
                self.release()
