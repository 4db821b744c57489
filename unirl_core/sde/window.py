"""Which denoising steps are stochastic (rollout) and which of them are trained (replay).

Rollout: every step (Flow-GRPO), or a window of ``w`` consecutive SDE steps whose start is drawn in
a range, ODE elsewhere (Flow-GRPO-Fast). Steps whose kernel is deterministic (any step of the
``ode`` kernel or at ``noise_level = 0``, the final step of ``cps`` / ``cps_gaussian``) are never SDE
steps: they have no log-prob. Training may further keep a fraction of the SDE steps (``timestep_fraction``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, field_error
from unirl_core.sde.kernels import step_is_stochastic
from unirl_core.types.sampling import DiffusionSamplingParams


def sde_step_mask(sampling: DiffusionSamplingParams, *, generator: torch.Generator | None = None) -> Tensor:
    """``[T]`` bool mask of SDE steps for one sample; the window start is drawn with ``generator`` (CPU)."""
    steps = sampling.num_steps
    mask = torch.zeros(steps, dtype=torch.bool)
    if sampling.sde_window_size is None:
        mask[:] = True
    else:
        size = sampling.sde_window_size
        lo, hi = sampling.sde_window_range or (0, steps)
        last_start = min(hi - 1, steps - size)
        start = lo + int(torch.randint(0, last_start - lo + 1, (1,), generator=generator).item())
        mask[start:start + size] = True
    for k in range(steps):
        if not step_is_stochastic(sampling.sde_type, sampling.noise_level, sampling.sigmas[k + 1]):
            mask[k] = False
    return mask


def select_train_steps(sde_mask: Tensor, *, fraction: float, generator: torch.Generator | None = None) -> list[int]:
    """Steps to train for a micro-batch: a random ``ceil(fraction * n)`` of the ``n`` steps that are SDE for any sample.

    ``sde_mask``: ``[B, T]`` bool. Returns sorted step indices; the same ``generator`` state gives
    the same subset, which is how pi_old replay and the loss agree on the steps.
    """
    if not (0 < fraction <= 1):
        raise field_error(ConfigError, "timestep_fraction", fraction, "a value in (0, 1]", "use 1.0 to train every SDE step")
    candidates = torch.nonzero(sde_mask.any(dim=0)).flatten().tolist()
    if fraction >= 1 or not candidates:
        return candidates
    keep = max(1, math.ceil(fraction * len(candidates)))
    order = torch.randperm(len(candidates), generator=generator)[:keep]
    return sorted(candidates[i] for i in order.tolist())


def sliding_window_start(step: int, *, num_steps: int, size: int, shift_interval: int, stride: int = 1) -> int:
    """MixGRPO's progressive sliding window (arXiv 2507.21802): the first denoising step of the SDE window at
    training step ``step`` (1-based).

    The window ``[l, l + size)`` starts at the first denoising step and moves ``stride`` steps towards the
    clean end every ``shift_interval`` training steps, then stays at the last position:
    ``l(step) = min(stride * floor((step - 1) / shift_interval), num_steps - size)``.
    """
    if not (1 <= size <= num_steps):
        raise field_error(ConfigError, "sampling.sde_window_size", size, f"an integer in [1, num_steps={num_steps}]",
                          "shrink the window or add steps")
    if not (shift_interval >= 1 and stride >= 1):
        raise field_error(ConfigError, "sampling.sde_window_shift_interval/stride", (shift_interval, stride),
                          "integers >= 1", "MixGRPO moves the window by 1 step every few training steps")
    if step < 1:
        raise field_error(ConfigError, "step", step, "a training step >= 1", "count steps from 1")
    return min(stride * ((step - 1) // shift_interval), num_steps - size)
