"""GRPO-Guard (arXiv 2510.22319) for Flow-GRPO: regulated clipping of the per-step ratio.

Why: Flow-GRPO's per-step log-ratio ``l = logp_new - logp_old`` is biased below 0 (its mean is minus the step KL)
and its spread scales like ``|b_k| / std_k`` (``mean = a x + b v``: a velocity change ``dv`` moves the mean by
``b_k dv``, measured in units of the step's std), so steps near the clean end have far wider ratio distributions.
A PPO clip of fixed width then bites on some steps and never on others, and the positive-advantage bound
``1 + eps`` is rarely reached: over-optimisation goes unchecked. Our reading of the paper's two remedies, per
replay slice and trained step k (``m`` = the step's trained entries, ``sg`` = stop-gradient):

    c_k = (std_k / |b_k|) / mean_{j trained} (std_j / |b_j|)       (analytic step scale, mean 1)
    RatioNorm:       l~ = (l - sg(mean_m l)) * c_k,  r~ = exp(l~)   (mean 0 and a step-independent spread)
    clip decision:   blocked = (A > 0 and r~ > 1 + eps) or (A < 0 and r~ < 1 - eps)
    grad reweight:   w_k = c_k if ``grad_reweight`` else 1
    loss entry:      -A * w_k * (sg(r) if blocked else r),  r = exp(l)

With ``ratio_norm: false`` the clip decision uses ``r`` itself, and with both off the gradient is Flow-GRPO's
(tested). ``l`` is 0 on a first update (one update per batch): RatioNorm only acts from the second update on
(``train.num_updates_per_batch > 1``), the reweighting always.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from unirl_core.algorithms.base import LossOutput, Policy
from unirl_core.algorithms.flow_grpo import (
    FlowGRPO,
    FlowGRPOConfig,
    _diffusion_parts,
    _StepReplay,
)
from unirl_core.algorithms.registry import register_algorithm
from unirl_core.errors import InvariantError, field_error
from unirl_core.sde.kernels import schedule_coefficients
from unirl_core.types import SampleBatch


@dataclass(frozen=True, kw_only=True)
class GRPOGuardConfig(FlowGRPOConfig):
    """Flow-GRPO's fields plus GRPO-Guard's two switches."""

    name: Literal["grpo_guard"] = field(default="grpo_guard", init=False)
    """Registry name."""
    ratio_norm: bool = True
    """Clip on the centred, step-scaled ratio ``r~`` instead of the raw ratio."""
    grad_reweight: bool = True
    """Weight step k's surrogate by ``c_k`` (equal gradient scale across denoising steps)."""


def step_scales(b: Tensor, std: Tensor, steps: list[int]) -> Tensor:
    """``c_k = (std_k / |b_k|) / mean_j(std_j / |b_j|)`` over the trained ``steps``: ``[T]`` coefficients -> ``[S]``."""
    raw = std[steps].double() / b[steps].double().abs()
    return (raw / raw.mean()).float()


def guarded_surrogate(new_logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, scale: float,
                      clip_range: float, adv_clip_max: float, ratio_norm: bool,
                      grad_reweight: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One step's entries ``[b]``: ``(per_entry_loss, ratio, normalised ratio)`` (formulas: module docstring)."""
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    log_ratio = new_logp - old_logp
    ratio = torch.exp(log_ratio)
    if ratio_norm:
        m = mask.to(log_ratio.dtype)
        centre = ((log_ratio * m).sum() / m.sum().clamp_min(1.0)).detach()
        normed = torch.exp((log_ratio - centre).detach() * scale)
    else:
        normed = ratio.detach()
    blocked = ((adv > 0) & (normed > 1 + clip_range)) | ((adv < 0) & (normed < 1 - clip_range))
    weight = scale if grad_reweight else 1.0
    per = -adv * weight * torch.where(blocked, ratio.detach(), ratio)
    return per, ratio, normed


class GRPOGuard(FlowGRPO):
    """Flow-GRPO with GRPO-Guard's RatioNorm and per-step gradient reweighting (``name: grpo_guard``)."""

    def __init__(self, config: GRPOGuardConfig | None = None) -> None:
        super().__init__(config or GRPOGuardConfig())
        self._scales: dict[int, float] = {}
        self._normed: list[Tensor] = []

    def loss_terms(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
                   first_update: bool = False) -> Generator[Tensor, None, LossOutput]:
        _, segs, sampling = _diffusion_parts(micro_batch)
        steps = self._train_steps(micro_batch, segs)
        _, b, std = schedule_coefficients(sampling.sde_type, segs[0].sigmas.float(), noise_level=sampling.noise_level)
        if steps and bool((b[steps] == 0).any() or (std[steps] == 0).any()):
            raise field_error(InvariantError, "grpo_guard step scale", "a trained step with b_k = 0 or std_k = 0",
                              "stochastic steps with a velocity term", "train SDE steps of a flow/dance/cps kernel")
        self._scales = dict(zip(steps, step_scales(b, std, steps).tolist())) if steps else {}
        self._normed = []
        out = yield from super().loss_terms(policy, micro_batch, old_log_probs=old_log_probs,
                                            first_update=first_update)
        if self._normed:
            normed = torch.cat(self._normed).cpu()
            cfg = self.config
            out.metrics.update({"guard_ratio_mean": float(normed.mean()), "guard_ratio_min": float(normed.min()),
                                "guard_ratio_max": float(normed.max()),
                                "guard_clip_frac": float(((normed - 1).abs() > cfg.clip_range).float().mean()),
                                "guard_scale_min": min(self._scales.values()),
                                "guard_scale_max": max(self._scales.values())})
        return out

    def step_surrogate(self, rep: _StepReplay, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.config
        per, ratio, normed = guarded_surrogate(rep.log_prob, old_logp, adv, mask, scale=self._scales[rep.step],
                                               clip_range=cfg.clip_range, adv_clip_max=cfg.adv_clip_max,
                                               ratio_norm=cfg.ratio_norm, grad_reweight=cfg.grad_reweight)
        self._normed.append(normed[mask.bool()].detach())
        return per, ratio


register_algorithm("grpo_guard", family="diffusion", config=GRPOGuardConfig, build=GRPOGuard)
