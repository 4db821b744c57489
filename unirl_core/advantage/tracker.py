"""Per-prompt reward statistics across steps (Flow-GRPO's per-prompt stat tracking).

A prompt seen in many steps is normalised against its own recent history instead of only the
``samples_per_prompt`` siblings of this step, which lowers the variance of the baseline when
groups are small. Until a prompt has ``min_count`` buffered rewards, the current batch's mean
and std stand in. The state is a plain dict of lists so a checkpoint can store it as JSON.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor

from unirl_core.advantage.config import AdvantageConfig, StatTrackerConfig
from unirl_core.advantage.group import clip_advantages, safe_divide
from unirl_core.errors import CheckpointError, InvariantError, field_error

STATE_VERSION = 1


class PerPromptStatTracker:
    """Ring buffers of recent rewards keyed by prompt; stateful, but its math is a plain function."""

    def __init__(self, cfg: StatTrackerConfig) -> None:
        self.cfg = cfg
        self._buffers: dict[str, deque[float]] = {}

    def __len__(self) -> int:
        return len(self._buffers)

    def history(self, key: str) -> list[float]:
        """The buffered rewards of ``key``, oldest first (empty if never seen)."""
        return list(self._buffers.get(key, ()))

    def update(self, keys: Sequence[str], rewards: Tensor) -> None:
        """Append this step's rewards ``[N]`` to their prompts' buffers, in order."""
        if len(keys) != rewards.numel() or rewards.ndim != 1:
            raise field_error(InvariantError, "keys/rewards", (len(keys), tuple(rewards.shape)),
                              "one key per reward of a 1-D tensor", "pass the prompt of every sample")
        if not bool(torch.isfinite(rewards).all()):
            raise field_error(InvariantError, "rewards", rewards.tolist(), "finite rewards",
                              "exclude invalid samples before tracking")
        for key, r in zip(keys, rewards.tolist()):
            buf = self._buffers.get(key)
            if buf is None:
                buf = self._buffers[key] = deque(maxlen=self.cfg.buffer_size)
            buf.append(float(r))

    def advantages(self, keys: Sequence[str], rewards: Tensor, cfg: AdvantageConfig) -> Tensor:
        """Record ``rewards`` [N] under ``keys`` then return advantages [N] against each prompt's stats.

        ``cfg.std_scope == 'global'`` divides by the batch std instead of the prompt's; ``'none'``
        only centres. Clipping follows ``cfg.clip``.
        """
        self.update(keys, rewards)
        r = rewards.to(torch.float64)
        batch_mean = r.mean() if r.numel() else torch.zeros((), dtype=torch.float64)
        correction = 1 if cfg.unbiased_std else 0
        batch_std = r.std(correction=correction) if r.numel() > correction else torch.zeros((), dtype=torch.float64)
        means = torch.empty_like(r)
        stds = torch.empty_like(r)
        for i, key in enumerate(keys):
            hist = self._buffers[key]
            if len(hist) >= self.cfg.min_count:
                h = torch.tensor(list(hist), dtype=torch.float64)
                means[i] = h.mean()
                stds[i] = h.std(correction=correction) if h.numel() > correction else 0.0
            else:
                means[i], stds[i] = batch_mean, batch_std
        centred = r - means
        if cfg.std_scope == "group":
            adv = safe_divide(centred, stds + cfg.eps)
        elif cfg.std_scope == "global":
            adv = safe_divide(centred, batch_std + cfg.eps)
        else:
            adv = centred
        return clip_advantages(adv, cfg.clip).to(rewards.dtype)

    def clear(self) -> None:
        self._buffers.clear()

    def state_dict(self) -> dict:
        """JSON-serialisable state: config plus ``{prompt: [rewards oldest first]}``."""
        return {"version": STATE_VERSION, "buffer_size": self.cfg.buffer_size, "min_count": self.cfg.min_count,
                "buffers": {k: list(v) for k, v in self._buffers.items()}}

    @classmethod
    def from_state_dict(cls, state: dict, cfg: StatTrackerConfig | None = None) -> PerPromptStatTracker:
        """Rebuild a tracker; ``cfg`` (if given) wins over the stored sizes, trimming longer buffers."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "buffers" not in state:
            raise field_error(CheckpointError, "stat_tracker.state", state, f"a dict with version={STATE_VERSION}"
                              " and 'buffers'", "store the tracker with PerPromptStatTracker.state_dict()")
        cfg = cfg or StatTrackerConfig(buffer_size=int(state["buffer_size"]), min_count=int(state["min_count"]))
        tracker = cls(cfg)
        for key, values in state["buffers"].items():
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
                raise field_error(CheckpointError, f"stat_tracker.buffers[{key!r}]", values, "finite numbers",
                                  "the stored tracker state is damaged; start a fresh tracker")
            tracker._buffers[str(key)] = deque((float(v) for v in values), maxlen=cfg.buffer_size)
        return tracker
