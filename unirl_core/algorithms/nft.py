"""DiffusionNFT (Zheng et al., arXiv 2509.16117): online RL on the forward (noising) process.

No SDE log-probs: the rollout may use any sampler (ODE included); only each sample's clean latent x0 (the last
latent of its trajectory) and its reward are used. Per sample b and trained noise level t (one of the pinned
schedule's sigmas), with seeded noise eps:

    x_t = (1 - t) x0 + t eps,              v = eps - x0                      (the flow-matching target)
    v+  = (1 - beta) v_old(x_t) + beta v_theta(x_t)                          (implicit positive policy)
    v-  = (1 + beta) v_old(x_t) - beta v_theta(x_t)                          (implicit negative policy)
    r   = 1/2 + 1/2 clip(A / Z, -1, 1)                                       (optimality probability in [0, 1])
    L   = r |v+ - v|^2 + (1 - r) |v- - v|^2        (mean over latent elements, then over samples and levels)

``A`` is the group-normalised advantage (so ``Z = reward_scale`` times the group std of the raw reward).
``v_old`` is the velocity of the sampling ("old") policy, evaluated once per batch under no grad
(``old_log_probs``) with the EMA weights (``old_policy: ema``, the paper's soft-updated sampling policy) or the
step's starting weights (``policy``). Minimising L over v_theta for one sample gives
``v_theta* = v_old + (2 r - 1) (v - v_old) / beta``: towards the data where r > 1/2, away where r < 1/2.
Shapes: B samples, K trained levels, latents ``[C, h, w]``.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from unirl_core.algorithms.base import LossOutput, Policy, summed_loss
from unirl_core.algorithms.flow_grpo import _advantages, _diffusion_parts
from unirl_core.algorithms.registry import register_algorithm
from unirl_core.errors import ConfigError, InvariantError, field_error
from unirl_core.models.diffusion import stack_conditions
from unirl_core.sde.noise import stable_seed
from unirl_core.types import DiffusionSegment, Part, SampleBatch


@dataclass(frozen=True, kw_only=True)
class DiffusionNFTConfig:
    """DiffusionNFT loss settings."""

    name: Literal["nft"] = field(default="nft", init=False)
    """Registry name."""
    beta: float = 1.0
    """Strength of the implicit policies: ``v+ = (1 - beta) v_old + beta v_theta``, ``v- = (1 + beta) v_old -
    beta v_theta``. 1.0 makes v+ the trained velocity itself."""
    reward_scale: float = 1.0
    """Z of ``r = 1/2 + 1/2 clip(A / Z, -1, 1)`` in units of the group-normalised advantage A."""
    timestep_fraction: float = 1.0
    """Fraction of the schedule's T noise levels trained per micro-batch (a seeded subset, the same in
    ``old_log_probs`` and ``loss``)."""
    old_policy: Literal["ema", "policy"] = "ema"
    """Weights of the sampling policy, which both samples the rollout and gives v_old: ``ema`` (the trainer's
    EMA, ``train.ema_decay`` required; the paper's soft update) or ``policy`` (the weights the step starts from)."""
    kl_beta: float = 0.0
    """Weight of ``mean |v_theta - v_ref|^2`` to the reference model (LoRA off / frozen copy); 0 skips it."""
    old_logp_source: Literal["replay"] = "replay"
    """pi_old is v_old, computed by the trainer (``old_log_probs``) over the training micro-batches: 'replay' only."""
    replay_batch_size: int | None = None
    """Samples per forward; None: the whole micro-batch."""
    seed: int = 0
    """Seed of the re-noising (levels and eps, keyed on the sample ids)."""

    def __post_init__(self) -> None:
        if not (self.beta > 0):
            raise field_error(ConfigError, "nft.beta", self.beta, "a value > 0", "use 1.0 (the paper's default)")
        if not (self.reward_scale > 0):
            raise field_error(ConfigError, "nft.reward_scale", self.reward_scale, "a value > 0", "use 1.0")
        if not (0 < self.timestep_fraction <= 1):
            raise field_error(ConfigError, "nft.timestep_fraction", self.timestep_fraction, "a value in (0, 1]",
                              "use 1.0 to train every noise level of the schedule")
        if self.old_policy not in ("ema", "policy"):
            raise field_error(ConfigError, "nft.old_policy", self.old_policy, "'ema' or 'policy'", "use 'ema'")
        if not (self.kl_beta >= 0):
            raise field_error(ConfigError, "nft.kl_beta", self.kl_beta, "a value >= 0", "use 0.0 to disable it")
        if self.old_logp_source != "replay":
            raise field_error(ConfigError, "nft.old_logp_source", self.old_logp_source, "'replay'",
                              "DiffusionNFT has no rollout log-probs: v_old is computed by the trainer; set "
                              "train.old_logp_source: replay")
        if self.replay_batch_size is not None and not (isinstance(self.replay_batch_size, int)
                                                       and self.replay_batch_size >= 1):
            raise field_error(ConfigError, "nft.replay_batch_size", self.replay_batch_size, "None or an integer >= 1",
                              "use e.g. 8")

    @property
    def rollout_weights(self) -> Literal["ema", "policy"]:
        """What the loop samples with: the sampling policy is v_old's."""
        return self.old_policy


def optimality_reward(advantages: Tensor, reward_scale: float) -> Tensor:
    """``r = 1/2 + 1/2 clip(A / Z, -1, 1)``: ``[B]`` advantages -> ``[B]`` in [0, 1]."""
    return 0.5 + 0.5 * (advantages / reward_scale).clamp(-1.0, 1.0)


def renoise(x0: Tensor, eps: Tensor, t: Tensor | float) -> tuple[Tensor, Tensor]:
    """Forward process of rectified flow: ``(x_t, v) = ((1 - t) x0 + t eps, eps - x0)``."""
    return (1 - t) * x0 + t * eps, eps - x0


def nft_loss_per_sample(v_theta: Tensor, v_old: Tensor, target: Tensor, r: Tensor, beta: float) -> Tensor:
    """``r |v+ - v|^2 + (1 - r) |v- - v|^2`` per sample (squares averaged over latent elements): ``[B, ...] ->
    [B]``."""
    v_pos = (1 - beta) * v_old + beta * v_theta
    v_neg = (1 + beta) * v_old - beta * v_theta
    dims = tuple(range(1, v_theta.ndim))
    pos = ((v_pos - target) ** 2).mean(dim=dims)
    neg = ((v_neg - target) ** 2).mean(dim=dims)
    return r * pos + (1 - r) * neg


@dataclass
class _Level:
    """One trained noise level of one replay slice."""

    rows: slice
    col: int
    """Index among the trained levels K."""
    x_t: Tensor
    target: Tensor
    sigma: Tensor
    conds: dict[str, Tensor]


class DiffusionNFT:
    """``SteppedAlgorithm`` for diffusion Parts; the policy must be a ``DiffusionBundle``-like object."""

    def __init__(self, config: DiffusionNFTConfig | None = None) -> None:
        self.config = config or DiffusionNFTConfig()

    @property
    def old_policy(self) -> Literal["ema", "policy"]:
        """Weights the train backend evaluates ``old_log_probs`` (v_old) under."""
        return self.config.old_policy

    # -- Algorithm ----------------------------------------------------------------------------
    @torch.no_grad()
    def old_log_probs(self, policy: Policy, micro_batch: SampleBatch) -> Tensor:
        """v_old ``[B, K, C, h, w]`` (fp32, policy device) at this micro-batch's re-noised points: the "pi_old"
        of NFT. The backend calls it once per batch, under the EMA weights when ``old_policy`` is ``ema``."""
        parts, segs, _ = _diffusion_parts(micro_batch)
        levels = self.train_levels(micro_batch, segs)
        out: Tensor | None = None
        for lv in self._levels(policy, parts, segs, levels):
            v = self._velocity(policy, lv)
            if out is None:
                out = torch.zeros(len(parts), len(levels), *v.shape[1:], dtype=torch.float32, device=v.device)
            out[lv.rows, lv.col] = v
        return out

    def loss(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
             first_update: bool = False) -> LossOutput:
        """The micro-batch loss as one graph; the backend calls ``loss_terms`` instead."""
        return summed_loss(self.loss_terms(policy, micro_batch, old_log_probs=old_log_probs,
                                           first_update=first_update))

    def num_loss_terms(self, micro_batch: SampleBatch) -> int:
        _, segs, _ = _diffusion_parts(micro_batch)
        size = self.config.replay_batch_size or len(segs)
        return -(-len(segs) // size) * len(self.train_levels(micro_batch, segs))

    def loss_terms(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
                   first_update: bool = False) -> Generator[Tensor, None, LossOutput]:
        """Yield one term per (replay slice, trained level); the terms add up to the mean loss over samples and
        levels (+ ``kl_beta`` x the mean squared velocity gap to the reference)."""
        cfg = self.config
        if old_log_probs is None:
            raise field_error(InvariantError, "old_log_probs (v_old)", None, "v_old from DiffusionNFT.old_log_probs",
                              "set train.old_logp_source: replay (the trainer computes v_old before the update)")
        parts, segs, _ = _diffusion_parts(micro_batch)
        levels = self.train_levels(micro_batch, segs)
        if tuple(old_log_probs.shape[:2]) != (len(parts), len(levels)):
            raise field_error(InvariantError, "old_log_probs (v_old).shape", tuple(old_log_probs.shape),
                              f"({len(parts)}, {len(levels)}, C, h, w)", "pass the output of old_log_probs for "
                              "exactly this micro-batch")
        r_all = optimality_reward(_advantages(parts), cfg.reward_scale)
        count = float(len(parts) * len(levels))
        sums = {"policy_loss": 0.0, "kl": 0.0, "pos_mse": 0.0, "neg_mse": 0.0, "v_old_absdiff": 0.0}
        worst = 0.0
        for lv in self._levels(policy, parts, segs, levels):
            v_theta = self._velocity(policy, lv)
            v_old = old_log_probs[lv.rows, lv.col].to(v_theta.device)
            r = r_all[lv.rows].to(v_theta.device)
            per = nft_loss_per_sample(v_theta, v_old, lv.target, r, cfg.beta)
            term = per.sum() / count
            sums["policy_loss"] += float(term.detach())
            if cfg.kl_beta > 0:
                with torch.no_grad(), policy.reference():
                    v_ref = self._velocity(policy, lv)
                kl = ((v_theta - v_ref) ** 2).mean(dim=tuple(range(1, v_theta.ndim))).sum() / count
                sums["kl"] += float(kl.detach())
                term = term + cfg.kl_beta * kl
            with torch.no_grad():
                ones = torch.ones_like(r)
                dims = tuple(range(1, v_theta.ndim))
                sums["pos_mse"] += float(nft_loss_per_sample(v_theta, v_old, lv.target, ones, cfg.beta).sum()) / count
                sums["neg_mse"] += float(nft_loss_per_sample(v_theta, v_old, lv.target, 0 * ones, cfg.beta).sum()) / count
                gap = (v_theta - v_old).abs()
                sums["v_old_absdiff"] += float(gap.mean(dim=dims).sum()) / count
                worst = max(worst, float(gap.max()))
            yield term
        total = sums["policy_loss"] + cfg.kl_beta * sums["kl"]
        metrics = {"loss": total, "policy_loss": sums["policy_loss"], "kl": sums["kl"],
                   "nft_pos_mse": sums["pos_mse"], "nft_neg_mse": sums["neg_mse"],
                   "v_old_absdiff_mean": sums["v_old_absdiff"], "v_old_absdiff_max": worst,
                   "optimality_mean": float(r_all.mean()), "advantage_mean": float(_advantages(parts).mean()),
                   "trained_steps": float(len(levels))}
        return LossOutput(loss=torch.tensor(total), metrics=metrics)

    # -- pieces -------------------------------------------------------------------------------
    def train_levels(self, micro_batch: SampleBatch, segs: list[DiffusionSegment]) -> list[int]:
        """Indices k into the pinned sigmas (``0 <= k < T``) trained for this micro-batch, ascending."""
        num = segs[0].sigmas.numel() - 1
        keep = max(1, round(self.config.timestep_fraction * num))
        if keep == num:
            return list(range(num))
        gen = torch.Generator().manual_seed(stable_seed(self.config.seed, "levels",
                                                        *[s.sample_id for s in micro_batch.samples]))
        return sorted(torch.randperm(num, generator=gen)[:keep].tolist())

    def _levels(self, policy: Policy, parts: list[Part], segs: list[DiffusionSegment],
                levels: list[int]) -> Iterator[_Level]:
        if not hasattr(policy, "guided_velocity"):
            raise field_error(ConfigError, "policy", type(policy).__name__, "a DiffusionBundle (guided_velocity)",
                              "train DiffusionNFT with unirl_core.models.diffusion.DiffusionBundle")
        device = policy.device
        size = self.config.replay_batch_size or len(parts)
        # re-noising runs on CPU in fp32 whatever device the trajectory sits on (a batch built on the GPU
        # without the Arrow round trip): the same bits in old_log_probs and loss, on every device
        sig = segs[0].sigmas.float().cpu()
        for lo in range(0, len(parts), size):
            rows = slice(lo, min(lo + size, len(parts)))
            chunk = range(rows.start, rows.stop)
            conds = stack_conditions([parts[i].conditions for i in chunk], device)
            x0 = torch.stack([segs[i].latents[-1] for i in chunk]).float().cpu()
            for col, k in enumerate(levels):
                # eps per (sample, level), drawn on CPU in fp32: the same bits in old_log_probs and loss
                eps = torch.stack([torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(
                    stable_seed(self.config.seed, "eps", parts[i].sample_id, k))) for i in chunk])
                x_t, target = renoise(x0, eps, sig[k])
                yield _Level(rows=rows, col=col, x_t=x_t.to(device), target=target.to(device),
                             sigma=sig[k].to(device), conds=conds)

    @staticmethod
    def _velocity(policy: Policy, lv: _Level) -> Tensor:
        # The conditional velocity: NFT trains without CFG whatever scale sampled the rollout.
        return policy.guided_velocity(lv.x_t, lv.sigma, lv.conds, guidance_scale=1.0)


register_algorithm("nft", family="diffusion", config=DiffusionNFTConfig, build=DiffusionNFT)
