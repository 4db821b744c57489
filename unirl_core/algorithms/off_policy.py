"""Off-policy correction against the behaviour policy: truncated / masked importance weights, staleness.

Three policies meet in an asynchronous (or dedicated-engine) update:

- ``pi_behav``: the policy that sampled the batch; its log-probs are the ones recorded at rollout
  (``TokenSegment.log_probs`` / ``DiffusionSegment.log_probs``), stamped with ``Part.policy_version``;
- ``pi_prox`` (= ``pi_old``): the trainer's weights before this batch's first update, replayed with
  ``train.old_logp_source: replay``; the clipped surrogate's trust region is around it;
- ``pi_theta``: the weights being optimised.

The behaviour weight ``rho = pi_prox / pi_behav`` corrects the mismatch (AReaL's decoupled objective,
Fu et al. 2025, eq. 5: ``J = E[ rho_t * min(u_t A, clip(u_t, 1 - eps, 1 + eps) A) ]`` with
``u_t = pi_theta / pi_prox``). Per token ``rho_t = exp(logp_prox_t - logp_behav_t)``; at sequence level
``rho = exp(sum_t (logp_prox_t - logp_behav_t))`` (the product of the token ratios), shared by the tokens.

- **TIS** (truncated IS, Yao et al. 2025; IMPALA's truncation): ``w = min(rho, C)``;
- **MIS** (masked IS, IcePop, Ling team 2025): ``w = rho`` if ``low <= rho <= high`` else ``0`` (the token,
  or the whole sequence, leaves the loss; the normaliser is unchanged, as in IcePop's objective);
- both: ``w = min(rho * 1[low <= rho <= high], C)``.

``w`` is detached. Nothing here is used unless a recipe asks for it, so on-policy runs are unchanged.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, field_error
from unirl_core.types import SampleBatch

ISLevel = Literal["token", "sequence"]

TRAINER_VERSION_KEY = "unirl.trainer_version"
"""Batch metadata key: the policy version the trainer holds when it trains the batch (stamped by the train
backend), so an algorithm can tell fresh rows (sampled by exactly those weights) from stale ones."""


def behaviour_weights(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, *, level: ISLevel,
                      tis_cap: float | None, mis_bounds: tuple[float, float] | None) -> tuple[Tensor, Tensor, Tensor]:
    """Importance weights ``[B, R]`` of pi_prox over pi_behav (detached), with the MIS mask and the TIS flags.

    ``prox_logp`` / ``behav_logp`` ``[B, R]`` log-probs, ``mask`` ``[B, R]`` loss tokens. Returns
    ``(weight, masked, truncated)``: ``weight`` 1 off ``mask``; ``masked`` / ``truncated`` bool ``[B, R]``,
    only on ``mask``.
    """
    m = mask.bool()
    d = (prox_logp.detach().float() - behav_logp.detach().float()) * m
    if level == "sequence":
        d = d.sum(-1, keepdim=True).expand_as(d) * m
    rho = torch.exp(d)
    masked = torch.zeros_like(m)
    weight = rho
    if mis_bounds is not None:
        low, high = mis_bounds
        masked = ((rho < low) | (rho > high)) & m
        weight = torch.where(masked, torch.zeros_like(rho), rho)  # where, not *: rho may be inf
    truncated = torch.zeros_like(m)
    if tis_cap is not None:
        truncated = (weight > tis_cap) & m
        weight = weight.clamp(max=tis_cap)
    weight = torch.where(m, weight, torch.ones_like(weight))
    return weight.to(prox_logp.dtype), masked, truncated


def sample_staleness(batch: SampleBatch) -> Tensor | None:
    """``[B]`` versions between each Part's sampling policy and the trainer's (``TRAINER_VERSION_KEY``), or
    None when the batch does not say which version trains it. EMA-sampled Parts (negative versions) count 0."""
    trainer = batch.metadata.get(TRAINER_VERSION_KEY)
    if trainer is None:
        return None
    versions = torch.tensor([p.policy_version for p in batch.generated], dtype=torch.long)
    return torch.where(versions >= 0, int(trainer) - versions, torch.zeros_like(versions))


def fresh_rows(batch: SampleBatch) -> Tensor:
    """``[B]`` bool: rows sampled by the trainer's current weights (all rows when the batch does not say).
    Only these can be held to a rollout-vs-replay tolerance; a stale row's gap is the policy's drift."""
    stale = sample_staleness(batch)
    return torch.ones(len(batch), dtype=torch.bool) if stale is None else stale == 0


def staleness_metrics(batch: SampleBatch) -> dict[str, float]:
    """``staleness_mean`` / ``staleness_max`` of the batch's samples (empty when the trainer version is unknown)."""
    stale = sample_staleness(batch)
    if stale is None or not len(stale):
        return {}
    return {"staleness_mean": float(stale.float().mean()), "staleness_max": float(stale.max())}


def check_is_config(prefix: str, level: str, tis_cap: float | None, mis_bounds) -> None:
    """Validate the shared IS knobs; errors name ``<prefix>.<field>``."""
    if level not in ("token", "sequence"):
        raise field_error(ConfigError, f"{prefix}.is_level", level, "'token' or 'sequence'", "pick one")
    if tis_cap is not None and not (tis_cap >= 1 and math.isfinite(tis_cap)):
        raise field_error(ConfigError, f"{prefix}.tis_cap", tis_cap, "a finite value >= 1 or None", "use e.g. 2.0")
    if mis_bounds is not None:
        ok = (isinstance(mis_bounds, (tuple, list)) and len(mis_bounds) == 2
              and all(isinstance(b, (int, float)) and math.isfinite(b) for b in mis_bounds)
              and 0 <= mis_bounds[0] <= 1 <= mis_bounds[1])
        if not ok:
            raise field_error(ConfigError, f"{prefix}.mis_bounds", mis_bounds, "[low, high] with 0 <= low <= 1 <= high",
                              "use e.g. [0.5, 2.0] (IcePop uses [0.5, 5.0])")
