"""Sigma schedules, SDE kernels, SDE-step selection and the NoiseRecipe sampler (torch + numpy only)."""

from unirl_core.sde.kernels import (
    StepOutput,
    cps_coefficients,
    cps_mean_std,
    dance_coefficients,
    dance_mean_std,
    flow_coefficients,
    flow_mean_std,
    gaussian_log_prob,
    kernel_coefficients,
    kernel_mean_std,
    ode_mean,
    schedule_coefficients,
    squared_distance_log_prob,
    step_is_stochastic,
    step_log_prob,
    transition,
)
from unirl_core.sde.noise import group_seed, initial_noise, sde_noise_generators, sibling_indices, stable_seed
from unirl_core.sde.schedules import dynamic_shift_mu, flow_sigmas, flux_sigmas, shift_sigmas, sigmas_tensor
from unirl_core.sde.window import sde_step_mask, select_train_steps

__all__ = [
    "StepOutput", "cps_coefficients", "cps_mean_std", "dance_coefficients", "dance_mean_std", "flow_coefficients",
    "kernel_coefficients", "schedule_coefficients", "dynamic_shift_mu", "flow_mean_std", "flow_sigmas",
    "flux_sigmas", "gaussian_log_prob", "group_seed", "initial_noise", "kernel_mean_std", "ode_mean",
    "sde_noise_generators", "sde_step_mask", "select_train_steps", "shift_sigmas", "sibling_indices",
    "sigmas_tensor", "squared_distance_log_prob", "stable_seed", "step_is_stochastic", "step_log_prob", "transition",
]
