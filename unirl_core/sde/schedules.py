"""Flow-matching sigma schedules, computed once in float32 and pinned on the Part.

The values reproduce diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps`` bit for bit
(static shift as in SD3, exponential dynamic shift as in Flux), so a schedule pinned here equals what
a stock pipeline would have used - but engines never call ``set_timesteps`` themselves: they take the
pinned tuple verbatim (diffusers re-shifts custom sigmas, which would shift them twice).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from unirl_core.errors import ConfigError, field_error
from unirl_core.types.sampling import as_float32_tuple


def _check_steps(num_steps: int) -> None:
    if not (isinstance(num_steps, int) and num_steps >= 1):
        raise field_error(ConfigError, "num_steps", num_steps, "an integer >= 1", "use e.g. 10 (tiny) or 40 (SD3)")


def shift_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """Static timestep shift ``s' = shift * s / (1 + (shift - 1) * s)`` (SD3)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_sigmas(*, num_steps: int, shift: float = 3.0, num_train_timesteps: int = 1000) -> tuple[float, ...]:
    """SD3-style schedule: ``num_steps + 1`` float32 sigmas from 1.0 down to the shifted minimum, then 0.

    Matches ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(num_steps).sigmas``.
    """
    _check_steps(num_steps)
    if not (shift > 0 and math.isfinite(shift)):
        raise field_error(ConfigError, "shift", shift, "a finite value > 0", "SD3 uses 3.0; 1.0 disables shifting")
    # The scheduler's training table (float32, shifted) fixes sigma_max / sigma_min.
    train_t = torch.from_numpy(np.linspace(1, num_train_timesteps, num_train_timesteps, dtype=np.float32)[::-1].copy())
    train_sigmas = shift_sigmas(train_t / num_train_timesteps, shift)
    sigma_max, sigma_min = train_sigmas[0].item(), train_sigmas[-1].item()
    timesteps = np.linspace(sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps)
    sigmas = shift_sigmas(timesteps / num_train_timesteps, shift)
    out = torch.cat([torch.from_numpy(sigmas).to(torch.float32), torch.zeros(1)])
    return as_float32_tuple(out.numpy())


def dynamic_shift_mu(image_seq_len: int, *, base_seq_len: int = 256, max_seq_len: int = 4096,
                     base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """Flux's resolution-dependent ``mu``: linear in the number of latent patches."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def flux_sigmas(*, num_steps: int, image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                base_shift: float = 0.5, max_shift: float = 1.15) -> tuple[float, ...]:
    """Flux-style schedule: linear sigmas in [1, 1/T], exponential time shift by ``mu``, then 0.

    Matches the Flux pipeline: ``set_timesteps(sigmas=linspace(1, 1/T, T), mu=mu)`` on a scheduler
    with ``use_dynamic_shifting=True``.
    """
    _check_steps(num_steps)
    if not (isinstance(image_seq_len, int) and image_seq_len >= 1):
        raise field_error(ConfigError, "image_seq_len", image_seq_len, "an integer >= 1",
                          "pass (height // 16) * (width // 16) for Flux")
    mu = dynamic_shift_mu(image_seq_len, base_seq_len=base_seq_len, max_seq_len=max_seq_len,
                          base_shift=base_shift, max_shift=max_shift)
    base = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
    sigmas = math.exp(mu) / (math.exp(mu) + (1 / base - 1) ** 1.0)
    out = torch.cat([torch.from_numpy(np.asarray(sigmas)).to(torch.float32), torch.zeros(1)])
    return as_float32_tuple(out.numpy())


def sigmas_tensor(sigmas: tuple[float, ...], device: torch.device | str | None = None) -> torch.Tensor:
    """The pinned tuple as a float32 tensor ``[T+1]`` (exact: every value is already float32)."""
    return torch.tensor(sigmas, dtype=torch.float32, device=device)
