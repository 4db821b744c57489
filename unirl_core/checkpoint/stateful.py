"""What the checkpoint package saves and restores: any object with these methods (``TrainBackend`` is one,
``unirl_core.train.stateful``). The package never imports the trainer."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class TrainState(Protocol):
    """A trainer's resumable state, as a versioned checkpoint holds it (``checkpoint.resume``)."""

    step_count: int
    policy_version: int
    compute_dtype: torch.dtype
    weights_scope: str

    def model_state_dict(self, dtype: torch.dtype | None = None, *, staging=None) -> dict[str, Tensor]:
        """The weights a version holds (full CPU tensors), optionally rounded to ``dtype`` and staged."""

    def load_model_state_dict(self, weights: dict[str, Tensor]) -> None: ...

    def state_dict(self) -> dict[str, object]:
        """Everything else to resume bit for bit: optimizer, scheduler, EMA (key ``ema``), RNG, counters."""

    def load_state_dict(self, state: dict[str, object]) -> None: ...

    def apply_config_hyperparameters(self) -> None:
        """After a restore: the run's config, not the checkpoint, sets the optimizer's hyperparameters."""

    def live_tensors(self) -> list[Tensor]:
        """What training changes in place next (a background write snapshots these first)."""

    def ema_weights(self, dtype: torch.dtype) -> dict[str, Tensor] | None: ...


class ShardedTrainState(Protocol):
    """A trainer's state as per-rank shards (``checkpoint.sharded``, torch.distributed.checkpoint)."""

    step_count: int
    policy_version: int
    optimizer_steps: int
    rank: int
    world_size: int

    def sharded_tensors(self) -> dict[str, object]:
        """The tensors DCP writes and loads in place (model, optimizer, EMA)."""

    def small_state(self, rank: int) -> dict[str, object]:
        """This rank's small state (RNG; rank 0: scheduler, scaler, counters), saved with ``torch.save``."""

    def load_sharded(self, tensors: dict[str, object], small0: dict[str, object],
                     mine: dict[str, object] | None) -> None: ...
