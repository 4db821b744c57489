"""Batch-level advantage assignment: read rewards off the Parts, normalise, filter, write back."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from unirl_core.advantage.config import AdvantageConfig
from unirl_core.advantage.group import clip_advantages, group_advantages, zero_std_groups
from unirl_core.advantage.tracker import PerPromptStatTracker
from unirl_core.types import SampleBatch


@dataclass(frozen=True, kw_only=True)
class AdvantageStats:
    """What ``assign_advantages`` did; every count is of samples unless it says groups."""

    num_samples: int
    """Samples in the input batch."""
    num_invalid: int
    """Samples excluded because ``valid`` was False or the reward missing / non-finite."""
    num_groups: int
    """Groups with at least one valid sample."""
    num_groups_dropped_zero_std: int
    """Groups dropped because all their valid rewards were equal (only with ``drop_zero_std_groups``)."""
    num_samples_dropped_zero_std: int
    """Valid samples removed with those groups."""
    num_kept: int
    """Samples in the returned batch (each has a finite ``advantage``)."""
    num_clipped: int
    """Kept samples whose advantage was clamped by ``cfg.clip``."""
    reward_mean: float
    """Mean reward over valid samples (nan if none)."""
    reward_std: float
    """Population std of the reward over valid samples (nan if none)."""
    advantage_mean: float
    """Mean advantage over kept samples (nan if none)."""
    advantage_abs_max: float
    """Largest absolute advantage over kept samples (nan if none)."""

    def as_metrics(self, prefix: str = "advantage/") -> dict[str, float]:
        """Flat float metrics for logging and decks."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _is_valid(part) -> bool:
    return bool(part.valid) and part.reward is not None and math.isfinite(part.reward)


def assign_advantages(batch: SampleBatch, cfg: AdvantageConfig,
                      tracker: PerPromptStatTracker | None = None) -> tuple[SampleBatch, AdvantageStats]:
    """Write ``Part.advantage`` on the generated Part of every kept sample.

    Reads ``reward``, ``valid`` and ``group_id`` of each Sample's generated Part. Invalid samples
    are excluded from the statistics; with a ``tracker`` the baseline is the prompt's history
    (keyed by the prompt text), else the group's siblings in this batch. The input Parts are
    updated in place (excluded ones get ``advantage=None``); the returned batch holds only kept
    samples (shared objects, batch order preserved) and the input metadata.
    """
    parts = batch.generated
    valid_idx = [i for i, p in enumerate(parts) if _is_valid(p)]
    for p in parts:
        p.advantage = None
    dense: dict[str, int] = {}
    group_index = torch.tensor([dense.setdefault(parts[i].group_id, len(dense)) for i in valid_idx],
                               dtype=torch.int64)
    rewards = torch.tensor([parts[i].reward for i in valid_idx], dtype=torch.float64)

    unclipped_cfg = dataclasses.replace(cfg, clip=None)
    if tracker is not None:
        adv = tracker.advantages([parts[i].prompt for i in valid_idx], rewards, unclipped_cfg)
    else:
        adv = group_advantages(rewards, group_index, unclipped_cfg)
    keep = torch.ones(len(valid_idx), dtype=torch.bool)
    dropped_groups = 0
    if cfg.drop_zero_std_groups and valid_idx:
        flat = zero_std_groups(rewards, group_index, atol=cfg.zero_std_atol)
        dropped_groups = int(flat.sum())
        keep = ~flat[group_index]

    kept_adv_raw = adv[keep]
    clipped = clip_advantages(kept_adv_raw, cfg.clip)
    num_clipped = int((clipped != kept_adv_raw).sum())
    kept_rows = [i for i, k in zip(valid_idx, keep.tolist()) if k]
    for i, a in zip(kept_rows, clipped.tolist()):
        parts[i].advantage = float(a)

    stats = AdvantageStats(
        num_samples=len(parts), num_invalid=len(parts) - len(valid_idx), num_groups=len(dense),
        num_groups_dropped_zero_std=dropped_groups, num_samples_dropped_zero_std=int((~keep).sum()),
        num_kept=len(kept_rows), num_clipped=num_clipped,
        reward_mean=float(rewards.mean()) if valid_idx else math.nan,
        reward_std=float(rewards.std(correction=0)) if valid_idx else math.nan,
        advantage_mean=float(clipped.mean()) if kept_rows else math.nan,
        advantage_abs_max=float(clipped.abs().max()) if kept_rows else math.nan,
    )
    return batch.select(kept_rows), stats


def drop_zero_std_groups(batch: SampleBatch, *, atol: float = 1e-6) -> tuple[SampleBatch, int]:
    """DAPO dynamic sampling's filter on its own: keep groups whose valid rewards differ.

    Returns the kept samples (invalid ones dropped too, shared objects, batch order) and the number
    of groups dropped for zero std, so the driver knows how many prompts to sample again.
    """
    parts = batch.generated
    valid_idx = [i for i, p in enumerate(parts) if _is_valid(p)]
    dense: dict[str, int] = {}
    group_index = torch.tensor([dense.setdefault(parts[i].group_id, len(dense)) for i in valid_idx],
                               dtype=torch.int64)
    if not valid_idx:
        return batch.select([]), 0
    rewards = torch.tensor([parts[i].reward for i in valid_idx], dtype=torch.float64)
    flat = zero_std_groups(rewards, group_index, atol=atol)
    keep = [i for i, g in zip(valid_idx, group_index.tolist()) if not bool(flat[g])]
    return batch.select(keep), int(flat.sum())
