"""Per-step transition kernels of a flow-matching sampler, with their step log-probs.

Convention (diffusers / rectified flow): ``x_sigma = (1 - sigma) * x_0 + sigma * eps``, the model
predicts the velocity ``v = eps - x_0``, and a step goes from ``sigma`` to ``sigma_next < sigma``.
Every kernel returns the Gaussian ``N(mean, std^2)`` of ``x_next`` given ``x``. The log-prob of a
step (``step_log_prob``) is averaged over the latent elements, so its scale does not depend on
resolution, and follows the public Flow-GRPO code (``sde_step_with_logprob`` in the flow_grpo
repository) kernel by kernel:

- ``flow``, ``dance``, ``cps_gaussian``: the full Gaussian log-density
  ``-(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi)`` (``gaussian_log_prob``); for ``flow``
  this is what the reference computes for its ``sde`` branch.
- ``cps``: ``-(x' - mean)^2`` (``squared_distance_log_prob``), the reference's ``cps`` branch. It
  is **not** the Gaussian log-density shifted by a constant: the ``1 / (2 std^2)`` factor stays in a
  ratio ``exp(logp_new - logp_old)``, so a clip range means something else under each. ``cps``
  matches the reference so that published CPS clip ranges carry over; ``cps_gaussian`` samples the
  very same transition with the density-correct log-prob.

The choice is part of ``DiffusionSamplingParams.sde_type``, pinned on each Part, so rollout and
replay always use the same one.

Shapes: ``model_output``, ``sample``: ``[B, C, H, W]``; ``sigma``, ``sigma_next``: float32 tensors
broadcastable to ``[B, 1, 1, 1]`` (0-d or per sample); log-probs: ``[B]``. All math runs in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, InvariantError, field_error
from unirl_core.types.sampling import SDE_TYPES, SDEType

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    """One transition. ``prev_sample`` is already round-tripped through the trajectory dtype."""

    prev_sample: Tensor
    """[B, C, H, W] next state, fp32 holding values exactly representable in the trajectory dtype."""
    mean: Tensor
    """[B, C, H, W] fp32 mean of the transition."""
    std: Tensor
    """fp32 std broadcastable to ``mean`` (0 for the ODE kernel)."""
    log_prob: Tensor
    """[B] fp32 step log-prob of ``prev_sample`` (``step_log_prob``); 0 where the step is deterministic."""


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Mean over non-batch dims of ``log N(x; mean, std^2)`` in fp32: ``[B, ...] -> [B]``."""
    x, mean, std = x.float(), mean.float(), std.float()
    z = (x - mean) / std
    lp = -0.5 * z * z - torch.log(std) - _HALF_LOG_2PI
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def squared_distance_log_prob(x: Tensor, mean: Tensor) -> Tensor:
    """Mean over non-batch dims of ``-(x - mean)^2`` in fp32: ``[B, ...] -> [B]``.

    The public Flow-GRPO code's CPS log-prob: the Gaussian log-density with ``log std``, ``log sqrt(2 pi)``
    **and** the ``1 / (2 std^2)`` scale dropped (only the first two are constant in a ratio).
    """
    d = x.float() - mean.float()
    lp = -(d * d)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def step_log_prob(sde_type: SDEType, x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Log-prob of a stochastic step ``x ~ N(mean, std^2)`` under ``sde_type``'s convention: ``[B, ...] -> [B]``.

    ``cps``: ``squared_distance_log_prob`` (as the Flow-GRPO reference); every other stochastic kernel,
    ``cps_gaussian`` included: ``gaussian_log_prob``. ``std`` must be > 0 (callers mask deterministic steps).
    """
    if sde_type == "cps":
        return squared_distance_log_prob(x, mean)
    if sde_type in ("flow", "dance", "cps_gaussian"):
        return gaussian_log_prob(x, mean, std)
    raise field_error(ConfigError, "sde_type", sde_type, "a stochastic kernel: flow, dance, cps or cps_gaussian",
                      "deterministic steps carry no log-prob")


def ode_mean(model_output: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """Euler step of the probability-flow ODE: ``x + (sigma_next - sigma) * v``."""
    return sample.float() + (sigma_next - sigma) * model_output.float()


def flow_coefficients(sigma: Tensor, sigma_next: Tensor, *, noise_level: float,
                      sigma_cap: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Flow-GRPO SDE (Liu et al. 2025): ``x' = x + [v + s_t^2/(2s) (x + (1-s) v)] dt + s_t sqrt(-dt) eps``.

    ``s_t = a sqrt(s / (1 - s))``. ``sigma_cap`` replaces ``sigma`` in ``1 - sigma`` where
    ``sigma == 1`` (the first step of a shifted schedule), where the diffusion coefficient would be
    infinite; Flow-GRPO uses the schedule's second sigma there. Returns ``(a, b, std)`` with
    ``mean = a x + b v``; sigmas may be 0-d (one step) or ``[T]`` (a whole schedule).
    """
    dt = sigma_next - sigma  # negative
    std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma >= 1, sigma_cap, sigma)))
    drift = std_t ** 2 / (2 * sigma) * dt
    return 1 + drift, dt + drift * (1 - sigma), std_t * torch.sqrt(-dt)


def dance_coefficients(sigma: Tensor, sigma_next: Tensor, *, noise_level: float) -> tuple[Tensor, Tensor, Tensor]:
    """DanceGRPO SDE (Xue et al. 2025): ``x' = x + [v - eta^2/2 score] ds + eta sqrt(s - s') eps``.

    With ``x0 = x - s v`` the score ``-(x - (1-s) x0) / s^2`` is ``-(x + (1-s) v) / s``, so the mean is
    linear in ``x`` and ``v``: ``(a, b, std)`` with ``mean = a x + b v``.
    """
    ds = sigma_next - sigma
    half = 0.5 * noise_level ** 2 * ds / sigma
    return 1 + half, ds + half * (1 - sigma), noise_level * torch.sqrt(sigma - sigma_next)


def cps_coefficients(sigma: Tensor, sigma_next: Tensor, *, noise_level: float) -> tuple[Tensor, Tensor, Tensor]:
    """Coefficients-preserving sampling (Wang & Yu 2025): ``x' = (1 - s') x0 + sqrt(s'^2 - std^2) eps_hat + std eps``.

    ``x0 = x - s v``, ``eps_hat = x + (1 - s) v``, ``std = s' sin(noise_level pi / 2)``: the next state
    keeps the form ``(1 - s') x0 + s' eps`` exactly. Deterministic at ``s' = 0``.
    """
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    c = torch.sqrt(sigma_next ** 2 - std ** 2)
    return (1 - sigma_next) + c, -sigma * (1 - sigma_next) + c * (1 - sigma), std


def kernel_coefficients(sde_type: SDEType, sigma: Tensor, sigma_next: Tensor, *, noise_level: float,
                        sigma_cap: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(a, b, std)`` of the kernel named by ``sde_type``: ``x_next ~ N(a x + b v, std^2)`` (``ode``: std 0)."""
    if sde_type == "flow":
        return flow_coefficients(sigma, sigma_next, noise_level=noise_level, sigma_cap=sigma_cap)
    if sde_type == "dance":
        return dance_coefficients(sigma, sigma_next, noise_level=noise_level)
    if sde_type in ("cps", "cps_gaussian"):
        return cps_coefficients(sigma, sigma_next, noise_level=noise_level)
    if sde_type == "ode":
        return torch.ones_like(sigma), sigma_next - sigma, torch.zeros_like(sigma)
    raise field_error(ConfigError, "sde_type", sde_type, f"one of {SDE_TYPES}", "pick a supported kernel")


def schedule_coefficients(sde_type: SDEType, sigmas: Tensor, *, noise_level: float) -> tuple[Tensor, Tensor, Tensor]:
    """Kernel coefficients of every step of a ``[T+1]`` schedule at once: three ``[T]`` fp32 tensors.

    Rollout and replay both take step k's coefficients from here, so both use the same numbers.
    """
    return kernel_coefficients(sde_type, sigmas[:-1], sigmas[1:], noise_level=noise_level, sigma_cap=sigmas[1])


def _linear_mean(a: Tensor, b: Tensor, model_output: Tensor, sample: Tensor) -> Tensor:
    return a * sample.float() + b * model_output.float()


def flow_mean_std(model_output: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor, *,
                  noise_level: float, sigma_cap: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and std of the Flow-GRPO kernel (see ``flow_coefficients``)."""
    a, b, std = flow_coefficients(sigma, sigma_next, noise_level=noise_level, sigma_cap=sigma_cap)
    return _linear_mean(a, b, model_output, sample), std


def dance_mean_std(model_output: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor, *,
                   noise_level: float) -> tuple[Tensor, Tensor]:
    """Mean and std of the DanceGRPO kernel (see ``dance_coefficients``)."""
    a, b, std = dance_coefficients(sigma, sigma_next, noise_level=noise_level)
    return _linear_mean(a, b, model_output, sample), std


def cps_mean_std(model_output: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor, *,
                 noise_level: float) -> tuple[Tensor, Tensor]:
    """Mean and std of the CPS kernel (see ``cps_coefficients``); ``cps`` and ``cps_gaussian`` share it."""
    a, b, std = cps_coefficients(sigma, sigma_next, noise_level=noise_level)
    return _linear_mean(a, b, model_output, sample), std


def kernel_mean_std(sde_type: SDEType, model_output: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor, *,
                    noise_level: float, sigma_cap: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and std of the kernel named by ``sde_type`` (``ode`` returns std 0)."""
    a, b, std = kernel_coefficients(sde_type, sigma, sigma_next, noise_level=noise_level, sigma_cap=sigma_cap)
    return _linear_mean(a, b, model_output, sample), std


def step_is_stochastic(sde_type: SDEType, noise_level: float, sigma_next: float) -> bool:
    """Whether a kernel has std > 0 at a step ending at ``sigma_next`` (only those carry log-probs)."""
    if sde_type == "ode" or noise_level == 0:
        return False
    return not (sde_type in ("cps", "cps_gaussian") and sigma_next == 0)


def transition(sde_type: SDEType, model_output: Tensor, sample: Tensor, sigma: Tensor, sigma_next: Tensor, *,
               sde_mask: Tensor, noise_level: float, sigma_cap: Tensor, trajectory_dtype: torch.dtype,
               noise: Tensor | None = None, prev_sample: Tensor | None = None,
               coefficients: tuple[Tensor, Tensor, Tensor] | None = None) -> StepOutput:
    """One step for a batch: SDE where ``sde_mask[b]``, Euler ODE elsewhere.

    Rollout passes ``noise`` ([B, C, H, W], any float dtype) and gets a new ``prev_sample``; replay
    passes the stored ``prev_sample`` and gets its log-prob. Either way the log-prob is taken of the
    state as stored (rounded to ``trajectory_dtype``), so rollout and replay see the same numbers;
    its convention is ``step_log_prob``'s for ``sde_type``.
    ``coefficients``: this step's ``(a, b, std)`` from ``schedule_coefficients`` (computed here when None).
    """
    if (noise is None) == (prev_sample is None):
        raise field_error(InvariantError, "transition(noise, prev_sample)", (noise is None, prev_sample is None),
                          "exactly one of noise (rollout) or prev_sample (replay)", "pass one of them")
    # Decided on the mask's own device: callers keep masks on CPU so a GPU rollout does not sync here.
    any_sde = sde_type != "ode" and bool(sde_mask.any())
    all_sde = any_sde and bool(sde_mask.all())
    # [B, 1, ..., 1]; only the mixed path needs it on the device (a pageable H2D copy waits for the GPU).
    mask_shape = (sde_mask.shape[0], *([1] * (sample.ndim - 1)))
    if not any_sde:
        mean = ode_mean(model_output, sample, sigma, sigma_next)
        std = torch.zeros(mask_shape, device=mean.device)
    else:
        # Where a sample is masked out, torch.where picks the Euler values; the selected values are
        # bitwise the same as on the all-SDE path, so slicing never changes a sample's numbers.
        if coefficients is None:
            coefficients = kernel_coefficients(sde_type, sigma, sigma_next, noise_level=noise_level,
                                               sigma_cap=sigma_cap)
        a, b, sde_std = coefficients
        mean = _linear_mean(a, b, model_output, sample)
        std = torch.as_tensor(sde_std, dtype=torch.float32, device=mean.device).expand(mask_shape)
        if not all_sde:
            mask = sde_mask.to(device=sample.device, dtype=torch.bool).view(mask_shape)
            mean = torch.where(mask, mean, ode_mean(model_output, sample, sigma, sigma_next))
            std = torch.where(mask, std, torch.zeros((), device=mean.device))
    if prev_sample is None:
        prev = (mean + std * noise.float()).to(trajectory_dtype).float()
    else:
        prev = prev_sample.float()
    if all_sde:
        log_prob = step_log_prob(sde_type, prev, mean, std)
    elif not any_sde:
        log_prob = torch.zeros(mean.shape[0], device=mean.device)
    else:
        safe_std = torch.where(std > 0, std, torch.ones_like(std))
        log_prob = torch.where(mask.reshape(-1), step_log_prob(sde_type, prev, mean, safe_std),
                               torch.zeros((), device=mean.device))
    return StepOutput(prev_sample=prev, mean=mean, std=std, log_prob=log_prob)
