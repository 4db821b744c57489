"""Versioned, crash-safe checkpoints over fsspec (local directory or s3://) and backend resume."""

from unirl_core.checkpoint.manifest import SCHEMA_VERSION, Manifest
from unirl_core.checkpoint.ref import CheckpointRef, step_dirname
from unirl_core.checkpoint.resume import restore_train_checkpoint, save_train_checkpoint
from unirl_core.checkpoint.store import (
    CheckpointStore,
    LoadedCheckpoint,
    load_checkpoint,
    load_manifest,
    load_version_json,
    load_weights,
)

__all__ = ["SCHEMA_VERSION", "CheckpointRef", "CheckpointStore", "LoadedCheckpoint", "Manifest", "load_checkpoint",
           "load_manifest", "load_version_json", "load_weights", "restore_train_checkpoint", "save_train_checkpoint", "step_dirname"]
