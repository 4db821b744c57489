"""``checkpoint.keep_batches``: the train phase keeps the batch it trains on, for replay and re-scoring."""

from __future__ import annotations

from unirl_core.checkpoint.batches import BatchStore
from unirl_core.config.loader import to_dict
from unirl_core.config.run import RunConfig
from unirl_core.train.distributed import current_world
from unirl_core.types import SampleBatch


def batch_store(cfg: RunConfig) -> BatchStore:
    """The per-step batches of run ``cfg.name`` (``<checkpoint.root>/<run>/batches``)."""
    return BatchStore(cfg.checkpoint.root, cfg.name, storage_options=cfg.checkpoint.storage_options)


def keep_batch(cfg: RunConfig, step: int, batch: SampleBatch) -> None:
    """Write step ``step``'s trained batch and the run config it ran with (rank 0 only: every rank of a multi-rank
    train phase holds the same batch, and two writers of one file race). ``cfg``: an RL run's or a composed run's
    config (a composed run's versions hold only each stack's config, so its recipe as it was is this file)."""
    if current_world()[0] == 0:
        batch_store(cfg).save(step, batch, config=to_dict(cfg))
