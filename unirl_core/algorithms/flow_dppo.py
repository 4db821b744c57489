"""Flow-DPPO: Flow-GRPO with a divergence trust region instead of the ratio clip.

Each trained denoising step is a Gaussian ``N(m, std_k^2)`` whose std the schedule fixes, so the new and old step
policies differ only in their means, and their KL is exact and cheap:

    KL_k,b = mean over latent elements of |m_new - m_old|^2 / (2 std_k^2)
    r      = exp(logp_new - logp_old),  A clamped to [-adv_clip_max, adv_clip_max]
    blocked = KL_k,b > kl_bound  and  A (r - 1) > 0          (past the trust region, still moving the favoured way)
    entry  = -A * (sg(r) if blocked else r)

The gradient of an entry is PPO's ``-A grad r`` inside the trust region and 0 once it has moved more than
``kl_bound`` in the direction its advantage favours: PPO's clipping pattern with the ratio box replaced by a KL
ball (the divergence-proximal idea; we know of no published flow formulation to transcribe, this is ours).
Moving back towards pi_old is never blocked. ``m_old`` is the mean of the replayed pi_old step, computed by
``old_log_probs`` before the first update (``train.old_logp_source: replay`` is required); on a first update the KL
is exactly 0, so the trust region acts from the second update on (``train.num_updates_per_batch > 1``).
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
    _fresh_mask,
    _StepReplay,
    gaussian_kl_same_std,
)
from unirl_core.algorithms.off_policy import TRAINER_VERSION_KEY
from unirl_core.algorithms.registry import register_algorithm
from unirl_core.errors import ConfigError, InvariantError, field_error
from unirl_core.types import SampleBatch


@dataclass(frozen=True, kw_only=True)
class FlowDPPOConfig(FlowGRPOConfig):
    """Flow-GRPO's fields, with the ratio clip replaced by ``kl_bound``."""

    name: Literal["flow_dppo"] = field(default="flow_dppo", init=False)
    """Registry name."""
    clip_range: float = field(default=1.0, init=False)
    """Unused: the trust region is ``kl_bound`` (kept so the inherited ``clip_frac`` metric is defined)."""
    kl_bound: float = 1e-4
    """Trust-region radius on the per-step Gaussian KL (mean over latent elements of ``|dm|^2 / (2 std^2)``)."""
    old_logp_source: Literal["replay"] = "replay"
    """``replay`` only: the trust region needs pi_old's step means, which the trainer replays before the update."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.kl_bound > 0):
            raise field_error(ConfigError, "flow_dppo.kl_bound", self.kl_bound, "a value > 0", "use e.g. 1e-4")
        if self.old_logp_source != "replay":
            raise field_error(ConfigError, "flow_dppo.old_logp_source", self.old_logp_source, "'replay'",
                              "the KL trust region needs pi_old's step means, replayed by the trainer; set "
                              "train.old_logp_source: replay")


def trust_region_surrogate(new_logp: Tensor, old_logp: Tensor, advantages: Tensor, kl: Tensor, *, kl_bound: float,
                           adv_clip_max: float) -> tuple[Tensor, Tensor, Tensor]:
    """``[b]`` entries: ``(per_entry_loss, ratio, blocked)`` (formulas: module docstring)."""
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(new_logp - old_logp)
    blocked = (kl.detach() > kl_bound) & (adv * (ratio.detach() - 1) > 0)
    return -adv * torch.where(blocked, ratio.detach(), ratio), ratio, blocked


class FlowDPPO(FlowGRPO):
    """``SteppedAlgorithm`` for diffusion Parts (``name: flow_dppo``)."""

    def __init__(self, config: FlowDPPOConfig | None = None) -> None:
        super().__init__(config or FlowDPPOConfig())
        # pi_old step means per micro-batch, keyed by (trainer version, sample ids): written by old_log_probs at
        # the start of a batch, read by every update of it; entries of other versions are dropped on write.
        self._old_means: dict[tuple, Tensor] = {}
        self._means: Tensor | None = None
        self._stats: dict[str, list[Tensor]] = {}

    @staticmethod
    def _key(micro_batch: SampleBatch) -> tuple:
        return (micro_batch.metadata.get(TRAINER_VERSION_KEY), tuple(s.sample_id for s in micro_batch.samples))

    @torch.no_grad()
    def old_log_probs(self, policy: Policy, micro_batch: SampleBatch) -> Tensor:
        """``[B, T]`` pi_old log-probs (as Flow-GRPO's), keeping pi_old's step means ``[B, S, C, h, w]`` for the loss."""
        parts, segs, sampling = _diffusion_parts(micro_batch)
        steps = self._train_steps(micro_batch, segs)
        full = torch.zeros(len(parts), sampling.num_steps, dtype=torch.float32)
        means: Tensor | None = None
        for rep in self._replay_steps(policy, parts, segs, sampling, steps, with_kl=False):
            full[rep.rows, steps[rep.col]] = rep.log_prob.cpu()
            if means is None:
                means = torch.zeros(len(parts), len(steps), *rep.mean.shape[1:], device=rep.mean.device)
            means[rep.rows, rep.col] = rep.mean
        stored = torch.stack([s.log_probs for s in segs])
        self._check_logp(stored[:, steps], full[:, steps], _fresh_mask(micro_batch, segs, steps), where="old_log_probs")
        key = self._key(micro_batch)
        self._old_means = {k: v for k, v in self._old_means.items() if k[0] == key[0]}
        self._old_means[key] = means
        return full

    def loss_terms(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
                   first_update: bool = False) -> Generator[Tensor, None, LossOutput]:
        self._means = self._old_means.get(self._key(micro_batch))
        if old_log_probs is None or self._means is None:
            raise field_error(InvariantError, "flow_dppo pi_old step means", None,
                              "means replayed by old_log_probs for this micro-batch",
                              "set train.old_logp_source: replay (the trainer replays pi_old before the update)")
        self._stats = {"kl": [], "blocked": []}
        out = yield from super().loss_terms(policy, micro_batch, old_log_probs=old_log_probs,
                                            first_update=first_update)
        kl, blocked = torch.cat(self._stats["kl"]).cpu(), torch.cat(self._stats["blocked"]).cpu()
        out.metrics.pop("clip_frac", None)
        out.metrics.update({"step_kl_mean": float(kl.mean()), "step_kl_max": float(kl.max()),
                            "trust_region_block_frac": float(blocked.float().mean())})
        return out

    def step_surrogate(self, rep: _StepReplay, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.config
        m_old = self._means[rep.rows, rep.col].to(rep.mean.device)
        b = rep.mean.shape[0]
        std = torch.where(rep.std > 0, rep.std, torch.ones_like(rep.std)).expand(b, 1, 1, 1)
        kl = gaussian_kl_same_std(rep.mean.detach(), m_old, std)
        per, ratio, blocked = trust_region_surrogate(rep.log_prob, old_logp, adv, kl, kl_bound=cfg.kl_bound,
                                                     adv_clip_max=cfg.adv_clip_max)
        sel = mask.bool()
        self._stats["kl"].append(kl[sel])
        self._stats["blocked"].append(blocked[sel])
        return per, ratio


register_algorithm("flow_dppo", family="diffusion", config=FlowDPPOConfig, build=FlowDPPO)
