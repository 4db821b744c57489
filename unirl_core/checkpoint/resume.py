"""Save / restore a trainer's state (``stateful.TrainState``: a ``TrainBackend``, say) through a CheckpointStore,
rank-aware under FSDP."""

from __future__ import annotations

import logging

import torch.distributed as dist

from unirl_core.checkpoint.delta import WeightsMemory
from unirl_core.checkpoint.ref import CheckpointRef
from unirl_core.checkpoint.store import (
    CheckpointStore,
    LoadedCheckpoint,
    load_checkpoint,
)
from unirl_core.checkpoint.stateful import TrainState
from unirl_core.checkpoint.writer import VersionWriter
from unirl_core.errors import CheckpointError, field_error

log = logging.getLogger(__name__)


def save_train_checkpoint(store: CheckpointStore, backend: TrainState, *, config: object | None = None,
                          extra: dict[str, object] | None = None, publish: bool = True,
                          overwrite: bool = False, full_state: bool = True,
                          writer: VersionWriter | None = None, memory: WeightsMemory | None = None) -> CheckpointRef:
    """Checkpoint the backend after its latest step: weights, EMA, optimizer/scheduler/RNG/counters, the run
    config and ``extra`` JSON state (e.g. the advantage stat tracker).

    ``full_state=False`` writes the version without ``train_state.pt`` (weights, EMA, config, extra): the
    resumable state is written elsewhen (``checkpoint.every_n_steps``) or elsewhere (``sharded.py``). Such a
    version is a publication artifact, never resumed from, so its weights and EMA are in the compute dtype (bf16
    for a bf16 model with fp32 masters: half the bytes): the values every reader (rollout bundle, engine, eval)
    gets after rounding the masters into that dtype anyway.
    Collective under FSDP: every rank gathers, rank 0 writes, all ranks return the same ref.

    ``writer`` (world size 1, ``publish=False``): the files are written on the writer's background thread
    from a snapshot taken now (``VersionWriter``); the ref is returned before the version exists. A weights-only
    version's GPU weights go to the writer's pinned buffers without a stall (``HostStaging``); the thread waits
    for those copies before it writes.

    ``memory`` (rank 0, without a writer; a writer brings its own): the last version written, which the store's
    encoding may write this one as a delta against (``checkpoint.delta``).
    """
    rank, world = current_world()
    if writer is not None:
        if world > 1 or publish:
            raise field_error(CheckpointError, "writer", "set", f"unset with world size {world} / publish={publish}",
                              "write asynchronously only in a single-rank process, and publish separately")
        writer.wait()  # the previous write has read its staged weights before they are overwritten
    if full_state:
        weights = backend.model_state_dict()
        state = backend.state_dict()
        ema = state.pop("ema")
    else:  # the per-step publication: its weights staged in the writer's pinned buffers (a GPU trainer)
        weights = backend.model_state_dict(dtype=backend.compute_dtype,
                                           staging=writer.staging if writer is not None else None)
        state, ema = None, backend.ema_weights(backend.compute_dtype)
    meta = {"weights_scope": backend.weights_scope, "world_size": str(world)}
    if writer is not None:
        return writer.save(store, backend.step_count, policy_version=backend.policy_version, live=backend.live_tensors(),
                           weights=weights, ema_weights=ema, train_state=state, config=config, extra=extra,
                           meta=meta, overwrite=overwrite)
    ref = None
    if rank == 0:
        ref = store.save(backend.step_count, weights=weights, ema_weights=ema, train_state=state, config=config,
                         extra=extra, policy_version=backend.policy_version, publish=publish, overwrite=overwrite,
                         meta=meta, memory=memory)
    if world > 1:
        box = [ref]
        dist.broadcast_object_list(box, src=0)
        ref = box[0]
    assert ref is not None
    return ref


def restore_train_checkpoint(backend: TrainState, ref: CheckpointRef, *,
                             storage_options: dict[str, object] | None = None) -> LoadedCheckpoint:
    """Load a version into the backend (weights, EMA, optimizer, scheduler, RNG, counters) so the next
    ``step`` equals the uninterrupted run's. Every rank reads (shared storage) and verifies checksums."""
    loaded = load_checkpoint(ref, storage_options=storage_options)
    if loaded.train_state is None:
        raise field_error(CheckpointError, ref.uri, "no train_state.pt", "a training checkpoint",
                          "this version holds weights only (load_weights); resume needs a training checkpoint")
    backend.load_model_state_dict(loaded.weights)
    state = dict(loaded.train_state)
    state["ema"] = loaded.ema_weights
    backend.load_state_dict(state)
    backend.apply_config_hyperparameters()
    if backend.policy_version != ref.policy_version:
        raise field_error(CheckpointError, f"{ref.uri}: policy_version", backend.policy_version,
                          f"{ref.policy_version} as in the manifest", "the checkpoint is inconsistent")
    log.info("resumed from %s (step %d)", ref.uri, ref.step)
    return loaded


def current_world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
