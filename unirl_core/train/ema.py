"""Exponential moving average of the trainable parameters (fp32 shadow copies).

Only algorithms that sample or evaluate with smoothed weights use it (e.g. Flow-GRPO NFT-style
recipes); GRPO must not, because its ratio needs the weights that actually produced the rollout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from unirl_core.errors import CheckpointError, field_error


class ParameterEMA:
    """``shadow <- decay * shadow + (1 - decay) * param`` after every optimizer step."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], decay: float) -> None:
        self.decay = decay
        self.names = [n for n, _ in named_params]
        self._params = [p for _, p in named_params]
        # Under FSDP2 these are DTensor shards; the shadow lives on the same shards, so it costs 1/world of memory.
        self.shadow: list[Tensor] = [p.detach().clone().float() for p in self._params]
        self.num_updates = 0

    @torch.no_grad()
    def update(self) -> None:
        current = [p.detach().float() for p in self._params]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)
        self.num_updates += 1

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Within this context the module's trainable parameters hold the EMA weights."""
        backup = [p.detach().clone() for p in self._params]
        with torch.no_grad():
            for p, s in zip(self._params, self.shadow):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self._params, backup):
                    p.copy_(b)

    def state_dict(self) -> dict[str, Tensor]:
        """Name -> shadow tensor (local shards under FSDP; the backend gathers full tensors to save)."""
        return dict(zip(self.names, self.shadow))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor], num_updates: int) -> None:
        missing = [n for n in self.names if n not in state]
        if missing:
            raise field_error(CheckpointError, "ema", missing[:5], "a shadow tensor for every trainable parameter",
                              "resume with the same LoRA/trainable layout the checkpoint was written with")
        for name, s in zip(self.names, self.shadow):
            s.copy_(state[name])
        self.num_updates = num_updates
