"""CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE with a clipped, stop-gradient importance-sampling weight.

Per token (shapes ``[B, R]``, ``mask`` = tokens in the loss):

    r_t  = exp(logp_t - logp_old_t)
    w_t  = sg(clip(r_t, 1 - epsilon_low, 1 + epsilon_high))      (no lower bound when epsilon_low is None)
    J    = sum_{i,t} w_t A_i logp_t / sum_i |o_i|                  (token-level normalisation)
    loss = -J  (+ beta * KL, times the TIS / MIS behaviour weight when ``tis_cap`` / ``mis_bounds`` is set, as in GRPO)

Unlike PPO/GRPO clipping, no token loses its gradient: a token whose ratio left the trust region keeps the
score-function gradient ``A * grad logp``, scaled by the truncated weight instead of being dropped.
Replay, the exactness checks and the metrics are GRPO's (``GRPO`` with another ``token_loss``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from unirl_core.algorithms.grpo import GRPO, LMLossConfig, LossAgg, finish_token_loss
from unirl_core.algorithms.registry import register_algorithm
from unirl_core.errors import ConfigError, field_error


@dataclass(frozen=True, kw_only=True)
class CISPOConfig(LMLossConfig):
    """CISPO's loss; the shared LM knobs (KL, TIS, truncation masking, overlong buffer) are ``LMLossConfig``'s."""

    name: Literal["cispo"] = field(default="cispo", init=False)
    loss_agg: LossAgg = "dapo"
    """Token-level normalisation, as in the paper (``dapo`` = token mean over the micro-batch)."""
    epsilon_high: float = 0.28
    """Upper truncation of the IS weight: ``w <= 1 + epsilon_high``. The paper tunes only this bound and gives
    no value; 0.28 is DAPO's clip-higher, the common starting point (larger values trust stale tokens more)."""
    epsilon_low: float | None = None
    """Lower truncation ``w >= 1 - epsilon_low``; None (default) imposes none, as in the paper."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0 < self.epsilon_high and math.isfinite(self.epsilon_high)):
            raise field_error(ConfigError, "cispo.epsilon_high", self.epsilon_high, "a finite value > 0",
                              "use e.g. 0.28")
        if self.epsilon_low is not None and not (0 < self.epsilon_low <= 1):
            raise field_error(ConfigError, "cispo.epsilon_low", self.epsilon_low, "None or a value in (0, 1]",
                              "leave it None (no lower bound, as in the paper)")


def cispo_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: CISPOConfig, *,
                     ref_logp: Tensor | None = None, rollout_logp: Tensor | None = None) -> tuple[Tensor, dict]:
    """The CISPO loss of one micro-batch. Pure: no model, no state.

    ``logp`` [B, R] current log-probs (with grad), ``old_logp`` [B, R] pi_old, ``advantages`` [B], ``mask``
    [B, R] bool; ``ref_logp`` when beta > 0, ``rollout_logp`` for TIS. Returns ``(loss, stats)``, stats as
    ``grpo_token_loss``'s (``clipped`` = the weight was truncated, at either bound).
    """
    mf = mask.to(logp.dtype)
    ratio = torch.exp((logp - old_logp.detach()) * mf).detach()
    low = 0.0 if cfg.epsilon_low is None else 1.0 - cfg.epsilon_low
    weight = ratio.clamp(min=low, max=1.0 + cfg.epsilon_high)
    adv = advantages.to(logp.dtype)[:, None]
    per_token = -weight * adv * logp
    loss, stats = finish_token_loss(per_token, logp, old_logp, mask, cfg, ref_logp=ref_logp,
                                    rollout_logp=rollout_logp)
    return loss, {"ratio": ratio, "clipped": (weight != ratio) & mask, **stats}


class CISPO(GRPO):
    """``Algorithm`` over AR Parts with the CISPO loss; replay, checks and metrics as ``GRPO``."""

    def __init__(self, config: CISPOConfig | None = None) -> None:
        super().__init__(config or CISPOConfig())

    def token_loss(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                   ref_logp: Tensor | None, rollout_logp: Tensor) -> tuple[Tensor, dict]:
        return cispo_token_loss(logp, old_logp, advantages, mask, self.config, ref_logp=ref_logp,
                                rollout_logp=rollout_logp)


register_algorithm("cispo", family="lm", config=CISPOConfig, build=CISPO)
