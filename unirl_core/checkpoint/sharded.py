"""The full resumable state, sharded per rank and written asynchronously (``torch.distributed.checkpoint``).

``<root>/<run>/state-00000012/`` next to the weights versions (``step-*``, which the store lists; this folder
it ignores):

```
__0_0.distcp, __1_0.distcp, ...   model, optimizer and EMA tensors: each rank writes its own shards (DCP)
.metadata                         DCP's index of the shards (written by rank 0 once every rank is done)
rank-00000.pt, rank-00001.pt      per rank: RNG; rank 0 also scheduler, scaler, counters (weights_only)
manifest.json                     sha256 + size of every file above, step, policy_version, counters in meta
                                  - written LAST, after the asynchronous write has finished and been hashed
```

``save_sharded_state`` returns once every tensor is staged (copied off the module); the write runs in a
background thread and ``PendingState.wait()`` finishes it (hash, manifest). A state folder without a valid
manifest does not exist to ``latest_state`` / ``load_sharded_state``, so a kill mid-write never yields a
partial state. Every rank calls save / wait / load (collectives on a gloo group of their own).
"""

from __future__ import annotations

import hashlib
import io
import logging
import posixpath
import re
from concurrent.futures import Future
from dataclasses import dataclass

import fsspec
import torch
import torch.distributed as dist

from unirl_core.checkpoint.fsio import Folder
from unirl_core.checkpoint.manifest import MANIFEST, Manifest
from unirl_core.checkpoint.stateful import ShardedTrainState
from unirl_core.errors import CheckpointError, field_error

log = logging.getLogger(__name__)

STATE_PREFIX = "state-"
_STATE_DIR = re.compile(r"^state-(\d{8})$")
KIND = "sharded-train-state"


def state_dirname(step: int) -> str:
    return f"{STATE_PREFIX}{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _small(backend: ShardedTrainState, rank: int) -> bytes:
    buf = io.BytesIO()
    torch.save(backend.small_state(rank), buf)
    return buf.getvalue()


def _group():
    """A gloo group of the train ranks for DCP's collectives (None at world 1 without a process group): the
    background write must not share the training group (NCCL) with the next step's collectives."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


def _writer(folder: Folder):
    from torch.distributed.checkpoint import FileSystemWriter

    if folder.local:
        return FileSystemWriter(folder.path, sync_files=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(folder.uri(), sync_files=True)


def _reader(folder: Folder):
    from torch.distributed.checkpoint import FileSystemReader

    if folder.local:
        return FileSystemReader(folder.path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(folder.uri())


@dataclass(frozen=True)
class StateRef:
    """A complete sharded state: its folder URI, step and policy version."""

    uri: str
    step: int
    policy_version: int


class PendingState:
    """An asynchronous state write in flight; ``wait()`` (every rank) completes it and returns the StateRef."""

    def __init__(self, folder: Folder, run: str, backend: ShardedTrainState, upload: Future | None, group,
                 rank: int, world: int) -> None:
        self.folder, self.run, self.upload, self.group = folder, run, upload, group
        self.rank, self.world = rank, world
        self.step, self.policy_version = backend.step_count, backend.policy_version
        self.optimizer_steps = backend.optimizer_steps
        self.ref: StateRef | None = None

    def done(self) -> bool:
        return self.upload is None or self.upload.done()

    def wait(self) -> StateRef:
        """Block until every rank's shards are written, then (rank 0) hash every file and write the manifest
        last. Raises CheckpointError naming the folder when the write failed (nothing is then visible)."""
        if self.ref is not None:
            return self.ref
        if self.upload is not None:
            try:
                self.upload.result()
            except Exception as e:  # DCP wraps a rank's failure in CheckpointException
                raise field_error(CheckpointError, self.folder.uri(), f"{type(e).__name__}: {e}",
                                  "a completed asynchronous state write", "check the storage; the previous "
                                  "complete state stays the resume point") from e
        if self.group is not None:
            dist.barrier(group=self.group)
        if self.rank == 0:
            files = {}
            for path in sorted(self.folder.fs.find(self.folder.path)):
                name = posixpath.relpath(path, self.folder.path)
                if name == MANIFEST or name.endswith(".tmp"):
                    continue
                h, size = hashlib.sha256(), 0
                with self.folder.fs.open(path, "rb") as f:
                    while chunk := f.read(8 << 20):
                        h.update(chunk)
                        size += len(chunk)
                files[name] = {"sha256": h.hexdigest(), "bytes": size}
            manifest = Manifest(run=self.run, step=self.step, policy_version=self.policy_version, files=files,
                                meta={"kind": KIND, "world_size": str(self.world),
                                      "optimizer_steps": str(self.optimizer_steps)})
            self.folder.write(MANIFEST, manifest.to_json(), atomic=True)
            log.info("sharded state %s complete (%.1f MB)", self.folder.uri(),
                     sum(f["bytes"] for f in files.values()) / 1e6)
        if self.group is not None:
            dist.barrier(group=self.group)  # no rank returns before the manifest exists
            dist.destroy_process_group(self.group)
            self.group = None
        self.ref = StateRef(self.folder.uri(), self.step, self.policy_version)
        return self.ref


def _run_folder(root: str, run: str, storage_options: dict[str, object] | None) -> Folder:
    fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    return Folder(fs, posixpath.join(path.rstrip("/"), run))


def save_sharded_state(root: str, run: str, backend: ShardedTrainState, *, asynchronous: bool = True,
                       storage_options: dict[str, object] | None = None) -> PendingState:
    """Write the backend's full resumable state after its latest step to ``<root>/<run>/state-<step>/``.

    Collective: every train rank calls it (and later ``wait()``). Returns once the tensors are staged, so
    the next step may change them; with ``asynchronous`` the write itself continues in the background.
    """
    import torch.distributed.checkpoint as dcp

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    folder = Folder(_run_folder(root, run, storage_options).fs,
                    _run_folder(root, run, storage_options).join(state_dirname(backend.step_count)))
    if rank == 0 and folder.fs.exists(folder.path):
        folder.fs.rm(folder.path, recursive=True)  # a partial folder of an interrupted write, or a rewrite
    group = _group()
    if group is not None:
        dist.barrier(group=group)
    folder.fs.makedirs(folder.path, exist_ok=True)
    folder.write(_rank_file(rank), _small(backend, rank))
    state = backend.sharded_tensors()
    kwargs = {"storage_writer": _writer(folder), "process_group": group, "no_dist": group is None}
    if not asynchronous:
        dcp.save(state, **kwargs)
        return PendingState(folder, run, backend, None, group, rank, world)
    response = dcp.async_save(state, **kwargs)
    staged = getattr(response, "staging_completion", None)
    if staged is not None:  # AsyncSaveResponse: staging may itself run in the background
        staged.result()
    upload = getattr(response, "upload_completion", response)
    return PendingState(folder, run, backend, upload, group, rank, world)


def state_versions(root: str, run: str, *, storage_options: dict[str, object] | None = None) -> list[StateRef]:
    """Complete sharded states of the run (valid manifest of this kind), oldest first."""
    run_folder = _run_folder(root, run, storage_options)
    run_folder.fs.invalidate_cache(run_folder.path)
    out = []
    for name in sorted(run_folder.listdir()):
        m = _STATE_DIR.match(name)
        if not m:
            continue
        folder = Folder(run_folder.fs, run_folder.join(name))
        manifest = _manifest(folder)
        if manifest is not None and manifest.step == int(m.group(1)):
            out.append(StateRef(folder.uri(), manifest.step, manifest.policy_version))
    return out


def latest_state(root: str, run: str, *, at_most: int | None = None,
                 storage_options: dict[str, object] | None = None) -> StateRef | None:
    """The newest complete state (of a step <= ``at_most``), or None."""
    found = [s for s in state_versions(root, run, storage_options=storage_options)
             if at_most is None or s.step <= at_most]
    return found[-1] if found else None


def _manifest(folder: Folder) -> Manifest | None:
    try:
        raw = folder.fs.cat_file(folder.join(MANIFEST))
    except FileNotFoundError:
        return None
    try:
        m = Manifest.from_json(raw, folder.uri(folder.join(MANIFEST)))
    except CheckpointError as e:
        log.warning("ignoring %s: %s", folder.uri(), e)
        return None
    return m if m.meta.get("kind") == KIND else None


def load_state_manifest(ref: StateRef, *, storage_options: dict[str, object] | None = None) -> Manifest:
    """A state's manifest alone (files, step, policy version, world size, optimizer steps): no tensor read."""
    fs, path = fsspec.core.url_to_fs(ref.uri, **(storage_options or {}))
    m = _manifest(Folder(fs, path.rstrip("/")))
    if m is None:
        raise field_error(CheckpointError, ref.uri, "no valid manifest", "a complete sharded state",
                          "resume from another state (latest_state)")
    return m


def load_sharded_state(backend: ShardedTrainState, ref: StateRef, *,
                       storage_options: dict[str, object] | None = None) -> Manifest:
    """Load a complete state into the backend (every rank): every file is checked against the manifest
    (size + sha256) first, then DCP reads each rank's shards in place (any world size: DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    manifest = load_state_manifest(ref, storage_options=storage_options)
    fs, path = fsspec.core.url_to_fs(ref.uri, **(storage_options or {}))
    folder = Folder(fs, path.rstrip("/"))
    for name in manifest.files:
        h, size = hashlib.sha256(), 0
        with fs.open(folder.join(name), "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
                size += len(chunk)
        manifest.verify_digest(name, size, h.hexdigest(), ref.uri)
    rank, world = backend.rank, backend.world_size
    saved_world = int(manifest.meta["world_size"])
    group = _group()
    state = backend.sharded_tensors()
    dcp.load(state, storage_reader=_reader(folder), process_group=group, no_dist=group is None)
    if group is not None:
        dist.destroy_process_group(group)
    small0 = torch.load(io.BytesIO(folder.read_verified(_rank_file(0), manifest)), weights_only=True)
    mine = None
    if saved_world == world:
        mine = small0 if rank == 0 else torch.load(
            io.BytesIO(folder.read_verified(_rank_file(rank), manifest)), weights_only=True)
    else:
        log.warning("state has RNG of %d ranks, job has %d: reseeding instead of restoring", saved_world, world)
    backend.load_sharded(state, small0, mine)
    if backend.policy_version != ref.policy_version:
        raise field_error(CheckpointError, f"{ref.uri}: policy_version", backend.policy_version,
                          f"{ref.policy_version} as in the manifest", "the state is inconsistent")
    log.info("restored sharded state %s (step %d)", ref.uri, ref.step)
    return manifest


def prune_states(root: str, run: str, *, keep_last: int, keep_every: int | None = None,
                 storage_options: dict[str, object] | None = None) -> list[int]:
    """Delete complete states outside the newest ``keep_last`` and the multiples of ``keep_every`` (the
    checkpoint store's retention), and partial folders older than the newest complete state (an interrupted
    write). A doomed state loses its manifest first. Returns the deleted steps."""
    run_folder = _run_folder(root, run, storage_options)
    complete = [s.step for s in state_versions(root, run, storage_options=storage_options)]
    keep = set(complete[-keep_last:]) | {s for s in complete if keep_every and s % keep_every == 0}
    newest = complete[-1] if complete else -1
    on_disk = sorted(int(m.group(1)) for n in run_folder.listdir() if (m := _STATE_DIR.match(n)))
    doomed = [s for s in on_disk if s not in keep and (s in complete or s < newest)]
    for step in doomed:
        folder = Folder(run_folder.fs, run_folder.join(state_dirname(step)))
        if step in complete:
            folder.fs.rm_file(folder.join(MANIFEST))
        folder.fs.rm(folder.path, recursive=True)
    return doomed
