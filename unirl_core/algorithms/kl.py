"""Per-token KL estimators of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

With ``d = logp - ref_logp`` (log pi/pi_ref at the sampled token), following Schulman's note
"Approximating KL Divergence":

- ``k1 = d``                       unbiased, high variance, can be negative;
- ``k2 = d**2 / 2``                biased, low variance, always >= 0;
- ``k3 = exp(-d) - 1 + d``         unbiased, low variance, always >= 0 (GRPO's default).

All three are pure elementwise functions; masking and aggregation happen in the loss.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, InvariantError, field_error

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator) -> Tensor:
    """Elementwise KL estimate, same shape as ``logp`` (e.g. ``[B, R]``); gradients flow through ``logp``."""
    if logp.shape != ref_logp.shape:
        raise field_error(InvariantError, "ref_logp.shape", tuple(ref_logp.shape), f"{tuple(logp.shape)}",
                          "replay the reference over the same layout as the policy")
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        # exp(-d) is clamped to keep one wild token from producing inf; 20 nats is far outside training.
        return torch.exp(-d.clamp(min=-20.0, max=20.0)) - 1.0 + d
    raise field_error(ConfigError, "kl_estimator", estimator, f"one of {KL_ESTIMATORS}", "use 'k3'")
