"""The denoising step shared by rollout and replay, and the rollout loop built on it.

Rollout and Flow-GRPO replay both call ``denoise_step`` with the same inputs (the stored latent of
step k, the same sigma tensors, the same conditions batch), so they run the very same ops and the
first update's ratio is exactly 1. Model calls go through ``velocity_fn(x_fp32, sigma) -> v_fp32``.

Shapes: B samples, T steps, latents ``[B, C, h, w]``; ``sde_mask`` ``[B, T]`` bool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from unirl_core.sde.kernels import StepOutput, schedule_coefficients, transition
from unirl_core.types.sampling import SDEType

VelocityFn = Callable[[Tensor, Tensor], Tensor]
"""``(x [B, C, h, w] fp32, sigma 0-d fp32) -> velocity [B, C, h, w] fp32``."""


def denoise_step(velocity_fn: VelocityFn, x: Tensor, k: int, sigmas: Tensor, *, sde_type: SDEType,
                 noise_level: float, sde_mask_k: Tensor, trajectory_dtype: torch.dtype,
                 noise: Tensor | None = None, prev_sample: Tensor | None = None,
                 coefficients: tuple[Tensor, Tensor, Tensor] | None = None) -> StepOutput:
    """Step ``k`` from ``x`` (fp32 holding trajectory-dtype values); ``sigmas`` is the ``[T+1]`` fp32 schedule.

    ``coefficients``: ``schedule_coefficients(sde_type, sigmas, ...)`` (``[T]`` each), computed once
    per trajectory by the caller; rollout and replay must both pass them or both not. The Flow-GRPO
    kernel's ``sigma == 1`` guard uses ``sigmas[1]``, as the reference implementation does.
    """
    sigma, sigma_next = sigmas[k], sigmas[k + 1]
    v = velocity_fn(x, sigma)
    step_coefs = None if coefficients is None else (coefficients[0][k], coefficients[1][k], coefficients[2][k])
    return transition(sde_type, v, x, sigma, sigma_next, sde_mask=sde_mask_k, noise_level=noise_level,
                      sigma_cap=sigmas[1], trajectory_dtype=trajectory_dtype, noise=noise, prev_sample=prev_sample,
                      coefficients=step_coefs)


@dataclass
class Trajectory:
    """A batch of rollouts as the loop produced them."""

    latents: Tensor
    """[B, T+1, C, h, w] in the trajectory dtype (``latents[:, 0]`` = x_T)."""
    log_probs: Tensor
    """[B, T] fp32 (0 on ODE steps)."""
    sigmas_used: Tensor
    """[T+1] fp32, recorded from the values the loop actually fed to each step."""


@torch.no_grad()
def sample_trajectory(velocity_fn: VelocityFn, x_T: Tensor, sigmas: Tensor, *, sde_type: SDEType,
                      noise_level: float, sde_mask: Tensor, trajectory_dtype: torch.dtype,
                      noise_fn: Callable[[int], Tensor]) -> Trajectory:
    """Run all T steps from ``x_T`` (any float dtype; rounded to the trajectory dtype first).

    ``noise_fn(k)`` returns the ``[B, C, h, w]`` standard-normal noise of step k (only read where
    ``sde_mask[:, k]`` has an SDE sample).
    """
    steps = sigmas.shape[0] - 1
    b = x_T.shape[0]
    latents = torch.empty((steps + 1, *x_T.shape), dtype=trajectory_dtype, device=x_T.device)
    log_probs = torch.zeros((steps, b), dtype=torch.float32, device=x_T.device)
    used = torch.empty(steps + 1, dtype=torch.float32, device=sigmas.device)
    latents[0] = x_T.to(trajectory_dtype)
    x = latents[0].float()
    zeros = None
    coefs = schedule_coefficients(sde_type, sigmas, noise_level=noise_level)
    for k in range(steps):
        mask_k = sde_mask[:, k]
        if bool(mask_k.any()):
            noise = noise_fn(k)
        else:
            zeros = torch.zeros_like(x) if zeros is None else zeros
            noise = zeros
        out = denoise_step(velocity_fn, x, k, sigmas, sde_type=sde_type, noise_level=noise_level, sde_mask_k=mask_k,
                           trajectory_dtype=trajectory_dtype, noise=noise, coefficients=coefs)
        used[k] = sigmas[k]
        latents[k + 1] = out.prev_sample.to(trajectory_dtype)
        log_probs[k] = out.log_prob
        x = out.prev_sample
    used[steps] = sigmas[steps]
    return Trajectory(latents=latents.transpose(0, 1), log_probs=log_probs.transpose(0, 1), sigmas_used=used)
