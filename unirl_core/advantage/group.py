"""Pure group-normalisation math.

Shapes: N = samples, G = groups. ``group_index[i]`` in ``[0, G)`` names the group of sample i;
siblings need not be adjacent. All statistics are taken in float64 and the result is cast back
to the dtype of ``rewards``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from unirl_core.advantage.config import AdvantageConfig
from unirl_core.errors import InvariantError, field_error


def _check_inputs(rewards: Tensor, group_index: Tensor) -> None:
    if not (isinstance(rewards, Tensor) and rewards.ndim == 1 and rewards.is_floating_point()):
        raise field_error(InvariantError, "rewards", getattr(rewards, "shape", type(rewards).__name__),
                          "a 1-D float tensor [N]", "pass one reward per sample")
    if not (isinstance(group_index, Tensor) and group_index.shape == rewards.shape
            and group_index.dtype == torch.int64):
        raise field_error(InvariantError, "group_index",
                          (getattr(group_index, "shape", None), getattr(group_index, "dtype", None)),
                          f"an int64 tensor of shape {tuple(rewards.shape)}",
                          "map group ids to integers with torch.unique(..., return_inverse=True)")
    if group_index.numel() and int(group_index.min()) < 0:
        raise field_error(InvariantError, "group_index", int(group_index.min()), "indices >= 0",
                          "use dense group indices 0..G-1")
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise field_error(InvariantError, "rewards", bad, "finite rewards only",
                          "exclude invalid samples before normalising (assign_advantages does this)")


def group_moments(rewards: Tensor, group_index: Tensor, *, unbiased: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group count, mean and std, each ``[G]`` float64 (G = max index + 1).

    A group with one member (or none) has std 0 under either estimator: it carries no spread.
    """
    _check_inputs(rewards, group_index)
    g = int(group_index.max()) + 1 if group_index.numel() else 0
    r = rewards.to(torch.float64)
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(r))
    total = torch.zeros(g, dtype=torch.float64).index_add_(0, group_index, r)
    mean = total / count.clamp(min=1)
    sq = torch.zeros(g, dtype=torch.float64).index_add_(0, group_index, (r - mean[group_index]) ** 2)
    denom = (count - 1) if unbiased else count
    std = torch.where(count > 1, (sq / denom.clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return count, mean, std


def group_advantages(rewards: Tensor, group_index: Tensor, cfg: AdvantageConfig) -> Tensor:
    """Group-normalised advantages ``[N]``: centre by the group mean, scale per ``cfg.std_scope``, clip.

    ``rewards`` [N] float, ``group_index`` [N] int64. Every entry must be finite: drop invalid
    samples first.
    """
    _, mean, std = group_moments(rewards, group_index, unbiased=cfg.unbiased_std)
    centred = rewards.to(torch.float64) - mean[group_index]
    if cfg.std_scope == "group":
        adv = safe_divide(centred, std[group_index] + cfg.eps)
    elif cfg.std_scope == "global":
        adv = safe_divide(centred, global_std(rewards, unbiased=cfg.unbiased_std) + cfg.eps)
    else:
        adv = centred
    return clip_advantages(adv, cfg.clip).to(rewards.dtype)


def safe_divide(centred: Tensor, denom: Tensor) -> Tensor:
    """``centred / denom`` with 0 where ``denom`` is 0 (a spread-less group has no signal, not nan)."""
    return torch.where(denom > 0, centred / torch.where(denom > 0, denom, torch.ones_like(denom)),
                       torch.zeros_like(centred))


def global_std(rewards: Tensor, *, unbiased: bool = False) -> Tensor:
    """Std of all rewards ``[N]`` as a float64 scalar (0 for fewer than two samples)."""
    if rewards.numel() < 2:
        return torch.zeros((), dtype=torch.float64)
    return rewards.to(torch.float64).std(correction=1 if unbiased else 0)


def clip_advantages(adv: Tensor, clip: float | None) -> Tensor:
    """Clamp to ``[-clip, clip]``; None returns ``adv`` unchanged."""
    return adv if clip is None else adv.clamp(-clip, clip)


def zero_std_groups(rewards: Tensor, group_index: Tensor, *, atol: float = 1e-6) -> Tensor:
    """Bool ``[G]``: True for groups whose population std is <= ``atol`` (no learning signal).

    Empty group indices (no member) count as zero-std too.
    """
    _, _, std = group_moments(rewards, group_index, unbiased=False)
    return std <= atol
