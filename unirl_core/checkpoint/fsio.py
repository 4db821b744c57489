"""File IO for the checkpoint store on one fsspec directory: hashed while streaming, atomic where possible."""

from __future__ import annotations

import hashlib
import os
import posixpath
import queue
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import fsspec
from fsspec.implementations.local import LocalFileSystem

from unirl_core.checkpoint.manifest import Manifest
from unirl_core.errors import CheckpointError, field_error

CHUNK = 8 << 20
OWNER_RUN = "run"
"""Key of a manifest file entry whose bytes live in another run's folder (a fork's start version references its
parent's files instead of copying them; ``CheckpointStore.save_reference``)."""
FORKS = "forks"
"""Folder of a run holding one pin file per fork that references one of its versions (retention keeps those)."""
Piece = bytes | memoryview


HASH_AHEAD = 1 << 20
"""From the first piece at least this big on, a file's pieces are hashed on a helper thread (``StreamHash``)."""


class StreamHash:
    """sha256 and size of a file's pieces, fed in file order as they are written.

    From the first big piece on, pieces are queued to a helper thread that hashes them in order while the caller
    goes on writing (hashlib and file writes both release the GIL for large buffers): the writer is not held to
    the hash's speed, so its page-cache writes and fsync overlap the hashing and a large file costs about
    max(sha256, write + fsync) instead of their sum. The queue holds views of the caller's pieces, no copies;
    ``hexdigest`` waits for the last one.
    """

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._queue: queue.SimpleQueue | None = None
        self._worker: Future | None = None
        self.size = 0

    def feed(self, piece: Piece) -> None:
        self.size += len(piece)
        if self._queue is None:
            if len(piece) < HASH_AHEAD:
                self._h.update(piece)
                return
            self._queue = queue.SimpleQueue()
            self._worker = _hash_pool().submit(self._drain, self._queue)
        self._queue.put(piece)

    def hexdigest(self) -> str:
        self._join()
        return self._h.hexdigest()

    def _drain(self, pieces: queue.SimpleQueue) -> None:
        while (piece := pieces.get()) is not None:
            self._h.update(piece)

    def _join(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
            worker, self._queue, self._worker = self._worker, None, None
            worker.result()


class ProcessThreadPool:
    """A ``ThreadPoolExecutor`` made on first use in each process. A forked child inherits the parent's executor
    object but none of its threads (nor, possibly, a free lock): every submit would wait forever, so a child that
    saves a checkpoint would hang. The pool is dropped in the child at fork and made anew on its first use there."""

    def __init__(self, workers: int, prefix: str) -> None:
        self._workers, self._prefix = workers, prefix
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        forget = weakref.WeakMethod(self._forget)  # a pool that is gone is not kept alive by the fork hook
        os.register_at_fork(after_in_child=lambda: (f := forget()) is not None and f())

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool, self._pid = None, os.getpid()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=self._prefix)
                self._pid = os.getpid()
            return self._pool


# Long-lived hashing threads (no thread start per file); several, so concurrent writers (a version and a sharded
# state) do not queue behind each other's hashes (a queued one only starts later: each writer ends its queue
# before it waits).
_HASH_POOL = ProcessThreadPool(8, "unirl-sha256")
# fsync threads, long-lived: no thread start per version
_SYNC_POOL = ProcessThreadPool(8, "unirl-fsync")


def _hash_pool() -> ThreadPoolExecutor:
    return _HASH_POOL.get()


def write_local(path: str, pieces: Iterable[Piece], *, sync: bool = True) -> tuple[str, int]:
    """Write pieces to ``path`` hashing them on the way (``StreamHash``: beside the write); fsync (unless
    ``sync=False``: the caller fsyncs it with ``sync_local`` before anything that depends on it) so a manifest
    never reaches the disk before the bytes it describes. A kill mid-way leaves a short file, which size +
    sha256 catch. Returns (sha256, size)."""
    h = StreamHash()
    try:
        with open(path, "wb") as f:
            for piece in pieces:
                h.feed(piece)
                f.write(piece)
            f.flush()
            if sync:
                os.fsync(f.fileno())
    finally:
        digest = h.hexdigest()  # also when the write failed: no hash left running over the caller's memory
    return digest, h.size


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # flushes the file's data whichever descriptor wrote it
    finally:
        os.close(fd)


def sync_local(paths: list[str]) -> None:
    """fsync ``paths`` concurrently and return when all are durable. ext4's journal folds the fsyncs in flight
    into one commit, so n files cost about one commit instead of n in a row (measured: 3 files 2-8 ms vs
    11-24 ms on the dev box's ext4)."""
    if len(paths) <= 1:
        for path in paths:
            _fsync_path(path)
        return
    list(_SYNC_POOL.get().map(_fsync_path, paths))


class Folder:
    """One directory (local path or object-store prefix) of a checkpoint store."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        self.local = isinstance(fs, LocalFileSystem)

    def join(self, *names: str) -> str:
        return posixpath.join(self.path, *names)

    def uri(self, path: str | None = None) -> str:
        path = self.path if path is None else path
        return path if self.local else self.fs.unstrip_protocol(path)

    def write(self, name: str, data: bytes, *, atomic: bool = False) -> str:
        """Write a small file; returns its sha256."""
        return self.write_pieces(name, [data], atomic=atomic)[0]

    def write_pieces(self, name: str, pieces: Iterable[Piece], *, atomic: bool = False,
                     sync: bool = True) -> tuple[str, int]:
        """Write ``name`` from a stream of pieces; returns (sha256, size).

        Local: ``atomic`` writes a temp file and ``os.replace``s it; ``sync=False`` (not with ``atomic``) leaves
        the fsync to a later :meth:`sync` of several files. Object stores: an object appears whole or
        not at all (one PUT, or a multipart upload completed on close), so every write is atomic there; an
        upload killed mid-way leaves an incomplete multipart upload that the bucket's lifecycle rules reap.
        """
        path = self.join(name)
        if self.local:
            target = path + ".tmp" if atomic else path
            os.makedirs(os.path.dirname(path), exist_ok=True)
            digest = write_local(target, pieces, sync=sync or atomic)
            if atomic:
                os.replace(target, path)
            return digest
        pieces = list(pieces)
        if len(pieces) == 1:
            self.fs.pipe_file(path, bytes(pieces[0]))
            return hashlib.sha256(pieces[0]).hexdigest(), len(pieces[0])
        h = StreamHash()
        try:
            with self.fs.open(path, "wb") as f:
                for piece in pieces:
                    h.feed(piece)
                    f.write(piece)
        finally:
            digest = h.hexdigest()
        return digest, h.size

    def sync(self, names: list[str]) -> None:
        """Make files written with ``sync=False`` durable (local: concurrent fsyncs); object stores hold an
        object once its upload completed, so there is nothing to do."""
        if self.local:
            sync_local([self.join(name) for name in names])

    def read_verified(self, name: str, manifest: Manifest) -> bytearray:
        """Read ``name`` into one buffer and check size and sha256 against the manifest (errors name the file).

        Remote reads hash chunk k on a second thread while chunk k+1 downloads; local reads are a memcpy from
        the page cache, so they hash inline.
        """
        entry = manifest.files.get(name)
        size = int(entry["bytes"]) if entry else 0
        path = self.file_path(name, manifest)
        buf = bytearray(size + 1)  # one spare byte reveals a file longer than recorded
        view = memoryview(buf)
        h = hashlib.sha256()
        got = 0
        try:
            with self.fs.open(path, "rb") as f, ThreadPoolExecutor(1) as pool:
                pending = None
                while got < len(buf):
                    n = f.readinto(view[got:min(got + CHUNK, len(buf))])
                    if not n:
                        break
                    if self.local:
                        h.update(view[got:got + n])
                    else:
                        if pending is not None:
                            pending.result()
                        pending = pool.submit(h.update, view[got:got + n])
                    got += n
                if pending is not None:
                    pending.result()
                if got == len(buf):
                    got += len(f.read())
        except FileNotFoundError:
            owner = manifest.files[name].get(OWNER_RUN) if name in manifest.files else None
            if owner is not None:
                raise field_error(CheckpointError, self.uri(path), "missing", f"the file of run {owner!r} that fork "
                                  f"{manifest.run!r}'s version {self.uri()} references",
                                  f"the parent's version was deleted outside the store (its retention keeps a "
                                  f"version a fork pins, {FORKS}/); restore it or fork another version") from None
            raise field_error(CheckpointError, self.uri(path), "missing", "an existing file",
                              "the version is incomplete; resume from another one") from None
        manifest.verify_digest(name, got, h.hexdigest(), self.uri())
        view.release()
        del buf[size:]
        return buf

    def file_path(self, name: str, manifest: Manifest) -> str:
        """Where file ``name`` of the version in this folder lives: here, or for a fork's start version (its manifest
        entry names an ``OWNER_RUN``) in the same step folder of that run, a sibling of this run under the root."""
        owner = (manifest.files.get(name) or {}).get(OWNER_RUN)
        if owner is None:
            return self.join(name)
        run_dir = posixpath.dirname(self.path)
        return posixpath.join(posixpath.dirname(run_dir), str(owner), posixpath.basename(self.path), name)

    def listdir(self) -> list[str]:
        self.fs.invalidate_cache(self.path)
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False)]
        except FileNotFoundError:
            return []
