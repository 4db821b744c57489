"""Each step's trained batch beside the run's versions: ``<root>/<run>/batches/step-00000012.arrow``.

Written by the train phase when ``checkpoint.keep_batches`` is on (the batch it trained on: the rollout, its
rewards and advantages, one Arrow IPC file with per-column checksums, ``unirl_core.io.ipc``); read by replay (is
step k reproducible from version k-1?) and re-scoring (what would another reward have said?). Retention never
prunes these files: a batch is what a version cannot tell you afterwards.

A local root is written in place (temp name + rename, as ``write_batch`` does); an ``s3://`` root gets the file
uploaded from a local temp file, and a read downloads it first (no memory map over the network).
"""

from __future__ import annotations

import json
import os
import posixpath
import tempfile

import fsspec
from fsspec.implementations.local import LocalFileSystem

from unirl_core.checkpoint.ref import parse_step_dirname, step_dirname
from unirl_core.errors import CheckpointError, field_error
from unirl_core.io.ipc import read_batch, write_batch
from unirl_core.types import SampleBatch

BATCH_DIR = "batches"
SUFFIX = ".arrow"
CONFIG_SUFFIX = ".config.json"


class BatchStore:
    """The per-step batches of one run under a root URL (the checkpoint root)."""

    def __init__(self, root: str, run: str, *, storage_options: dict[str, object] | None = None) -> None:
        if not run or "/" in run:
            raise field_error(CheckpointError, "run", run, "a non-empty run name without '/'", "pass the run name")
        self.fs, path = fsspec.core.url_to_fs(root, **dict(storage_options or {}))
        self.path = posixpath.join(path.rstrip("/"), run, BATCH_DIR)
        self.local = isinstance(self.fs, LocalFileSystem)

    @property
    def uri(self) -> str:
        return self.fs.unstrip_protocol(self.path)

    def _file(self, step: int) -> str:
        return posixpath.join(self.path, step_dirname(step) + SUFFIX)

    def _config_file(self, step: int) -> str:
        return posixpath.join(self.path, step_dirname(step) + CONFIG_SUFFIX)

    def config(self, step: int) -> dict | None:
        """The run config stored with step ``step``'s batch (None when the batch was stored without one)."""
        path = self._config_file(step)
        return json.loads(self.fs.cat_file(path)) if self.fs.exists(path) else None

    def save(self, step: int, batch: SampleBatch, *, config: dict | None = None) -> str:
        """Write step ``step``'s batch (replacing one an interrupted attempt at that step left) and, when given, the
        run config the step ran with (``step-XXXXXXXX.config.json``); returns the batch's URL."""
        self.fs.makedirs(self.path, exist_ok=True)
        target = self._file(step)
        if config is not None:
            self.fs.pipe_file(self._config_file(step), json.dumps(config, sort_keys=True, indent=1).encode())
        if self.local:
            write_batch(batch, target)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                local = os.path.join(tmp, "batch" + SUFFIX)
                write_batch(batch, local)
                self.fs.put_file(local, target)
        return self.fs.unstrip_protocol(target)

    def steps(self) -> list[int]:
        """Steps that have a stored batch, ascending."""
        self.fs.invalidate_cache(self.path)
        if not self.fs.exists(self.path):
            return []
        names = [posixpath.basename(p) for p in self.fs.ls(self.path, detail=False)]
        found = (parse_step_dirname(n[:-len(SUFFIX)]) for n in names if n.endswith(SUFFIX))
        return sorted(s for s in found if s is not None)

    def has(self, step: int) -> bool:
        return self.fs.exists(self._file(step))

    def load(self, step: int) -> SampleBatch:
        """Step ``step``'s batch, checksums verified (a changed byte raises ``SchemaError`` naming the column)."""
        target = self._file(step)
        if not self.fs.exists(target):
            raise CheckpointError(f"no stored batch of step {step} ({self.fs.unstrip_protocol(target)}): the run did "
                                  "not keep it (checkpoint.keep_batches was off when the step ran); train with "
                                  "checkpoint.keep_batches=true to keep every step's batch")
        if self.local:
            return read_batch(target, verify=True)
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, "batch" + SUFFIX)
            self.fs.get_file(target, local)
            return read_batch(local, memory_map=False, verify=True)
