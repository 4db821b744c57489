"""ELBO policy gradient (Choi et al., arXiv 2602.04663): the final sample's likelihood from the diffusion ELBO.

The log-likelihood of a generated clean latent ``x0`` under a rectified-flow policy is estimated, up to a constant,
by minus a weighted velocity-matching error at re-noised points (no trajectory, so any sampler may roll out; the
ODE by default). Per sample b and estimator pair j = (t, eps):

    x_t   = (1 - t) x0 + t eps,      target v* = eps - x0,      x0_hat = x_t - t v(x_t, t)   (no CFG)
    ELBO  = - mean |v - v*|^2                                   weighting 'velocity'
          = - mean |x0_hat - x0|^2          (= t^2 |v - v*|^2)  weighting 'x0'
          = - mean |x0_hat - x0|^2 / sg(mean |x0_hat - x0|)     weighting 'adaptive' (the authors' default)
    log r = sg(ELBO_theta) - ELBO_old   (the same (t, eps) for both),   r = exp(log r)
    EPG:   L = - sg(r) A ELBO_theta
    PEPG:  L = - sg(r) (A - log r) ELBO_theta
    PAR:   L = 1/2 sg(r) (A - (ELBO_theta - ELBO_old))^2
    total = mean over samples and pairs of L  +  kl_beta * mean |v_theta - v_ref|^2

``A`` is the Part's advantage times ``advantage_scale`` (clamped to ``adv_clip_max`` when set). ELBO_old is the
sampling ("old") policy's ELBO, evaluated once per batch under no grad by ``old_log_probs`` - the step's starting
weights (``old_policy: policy``) or the trainer's EMA (``ema``) - so ``train.old_logp_source: replay`` is required.

Estimator draws (the numerics contract): each sample's pairs come from one CPU generator seeded by ``seed`` and a
stable hash of the sample's initial noise x_T (``latents[0]``, drawn from the rollout's NoiseRecipe): first a
permutation of the pinned schedule's T noise levels (keep ``floor(T * timestep_fraction)``, at least 1), then
``noise_draws`` fp32 eps per kept level. The draws depend on nothing else (not on the micro-batch slicing, the
device or the step), so ``old_log_probs`` and ``loss`` see the same bits: the first update's ratio is exactly 1 and
a replay is bitwise. Siblings sharing x_T (``same_noise_per_group``) share their pairs too.

Where the formulas come from: the abstract and third-party reviews of the paper (its full text was not reachable
here) and the authors' public code (jaemoo-choi/rethinking-diffusion-rl: the ELBO weightings, the EPG / PEPG / PAR
objectives, one eps per trained sampler timestep, timestep_fraction 0.99). V-GRPO (arXiv 2604.23380) is not
implemented: docs/algorithms.md lists what its reachable description leaves open. Shapes: B samples, P = K levels x
``noise_draws`` pairs, latents ``[C, h, w]``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from unirl_core.algorithms.base import LossOutput, Policy, summed_loss
from unirl_core.algorithms.flow_grpo import _advantages, _diffusion_parts
from unirl_core.algorithms.off_policy import staleness_metrics
from unirl_core.algorithms.registry import register_algorithm
from unirl_core.errors import ConfigError, InvariantError, NumericsError, field_error
from unirl_core.models.diffusion import stack_conditions
from unirl_core.sde.noise import stable_seed
from unirl_core.types import DiffusionSegment, Part, SampleBatch

Objective = Literal["epg", "pepg", "par"]
Weighting = Literal["adaptive", "x0", "velocity"]
_OBJECTIVES = ("epg", "pepg", "par")
_WEIGHTINGS = ("adaptive", "x0", "velocity")


@dataclass(frozen=True, kw_only=True)
class ELBOPGConfig:
    """ELBO policy-gradient settings (formulas: the module docstring)."""

    name: Literal["elbo_pg"] = field(default="elbo_pg", init=False)
    """Registry name."""
    objective: Literal["epg", "pepg", "par"] = "pepg"
    """``epg`` (REINFORCE with a detached ratio), ``pepg`` (EPG with the advantage lowered by the log-ratio, the
    paper's headline GenEval run) or ``par`` (squared regression of the log-ratio onto the advantage)."""
    weighting: Literal["adaptive", "x0", "velocity"] = "adaptive"
    """Weight of the velocity-matching error inside the ELBO: ``adaptive`` (x0-prediction error over its own detached
    mean absolute value, the authors' default), ``x0`` (x0-prediction error, i.e. ``t^2`` times the velocity error)
    or ``velocity`` (plain velocity error)."""
    timestep_fraction: float = 0.99
    """Fraction of the pinned schedule's T noise levels each sample is trained at: ``floor(T * fraction)`` levels
    (at least 1), a per-sample random subset without replacement (0.99 of 10 steps: 9 levels, as the authors)."""
    noise_draws: int = 1
    """eps draws per kept level; each (level, eps) pair is one ELBO term with its own ratio."""
    advantage_scale: float = 1.0
    """Multiplies the Part's advantage (the authors' runs: 0.1 times the group-centred reward, with
    ``advantage.std_scope: none``)."""
    adv_clip_max: float | None = None
    """Clamp the scaled advantage to ``[-adv_clip_max, adv_clip_max]``; None (the paper: no clipping) leaves it."""
    kl_beta: float = 0.0
    """Weight of ``mean |v_theta - v_ref|^2`` to the reference (LoRA off / frozen copy) at the same points (the
    authors' 'girsanov' KL, 1e-4 in their runs); 0 skips the reference forward."""
    old_policy: Literal["policy", "ema"] = "policy"
    """Weights of the sampling policy, which rolls out and gives ELBO_old: ``policy`` (the weights the step starts
    from: the first update's ratio is exactly 1) or ``ema`` (the trainer's EMA; ``train.ema_decay`` required)."""
    old_logp_source: Literal["replay"] = "replay"
    """ELBO_old is computed by the trainer (``old_log_probs``) over the training micro-batches: 'replay' only."""
    replay_batch_size: int | None = None
    """Samples per forward; None: the whole micro-batch."""
    elbo_tolerance: float | None = 1e-3
    """Fail closed when, on a first update with ``old_policy: policy``, max |ELBO_theta - ELBO_old| exceeds this
    (the two are the same function of the same weights and draws); None disables the check."""
    seed: int = 0
    """Mixed into every sample's estimator seed (with the hash of its x_T)."""

    def __post_init__(self) -> None:
        if self.objective not in _OBJECTIVES:
            raise field_error(ConfigError, "elbo_pg.objective", self.objective, f"one of {_OBJECTIVES}",
                              "use 'pepg' (the paper's headline run) or 'epg'")
        if self.weighting not in _WEIGHTINGS:
            raise field_error(ConfigError, "elbo_pg.weighting", self.weighting, f"one of {_WEIGHTINGS}",
                              "use 'adaptive' (the authors' default)")
        if not (isinstance(self.timestep_fraction, (int, float)) and 0 < self.timestep_fraction <= 1):
            raise field_error(ConfigError, "elbo_pg.timestep_fraction", self.timestep_fraction, "a value in (0, 1]",
                              "use 0.99 (the authors') or 1.0 to train every level of the schedule")
        if not (isinstance(self.noise_draws, int) and not isinstance(self.noise_draws, bool) and self.noise_draws >= 1):
            raise field_error(ConfigError, "elbo_pg.noise_draws", self.noise_draws, "an integer >= 1",
                              "use 1 (one eps per trained level, as the authors)")
        if not (isinstance(self.advantage_scale, (int, float)) and self.advantage_scale > 0):
            raise field_error(ConfigError, "elbo_pg.advantage_scale", self.advantage_scale, "a value > 0", "use 1.0")
        if self.adv_clip_max is not None and not (self.adv_clip_max > 0):
            raise field_error(ConfigError, "elbo_pg.adv_clip_max", self.adv_clip_max, "None or a value > 0",
                              "use None (no clipping) or e.g. 5.0")
        if not (isinstance(self.kl_beta, (int, float)) and self.kl_beta >= 0):
            raise field_error(ConfigError, "elbo_pg.kl_beta", self.kl_beta, "a value >= 0", "use 0.0 to disable it")
        if self.old_policy not in ("policy", "ema"):
            raise field_error(ConfigError, "elbo_pg.old_policy", self.old_policy, "'policy' or 'ema'", "use 'policy'")
        if self.old_logp_source != "replay":
            raise field_error(ConfigError, "elbo_pg.old_logp_source", self.old_logp_source, "'replay'",
                              "ELBO-PG has no rollout log-probs: the trainer computes ELBO_old; set "
                              "train.old_logp_source: replay")
        if self.replay_batch_size is not None and not (isinstance(self.replay_batch_size, int)
                                                       and self.replay_batch_size >= 1):
            raise field_error(ConfigError, "elbo_pg.replay_batch_size", self.replay_batch_size,
                              "None or an integer >= 1", "use e.g. 8")
        if self.elbo_tolerance is not None and not (self.elbo_tolerance >= 0):
            raise field_error(ConfigError, "elbo_pg.elbo_tolerance", self.elbo_tolerance, "None or a value >= 0",
                              "use e.g. 1e-3, or 0.0 to demand bit-exactness")

    @property
    def rollout_weights(self) -> Literal["policy", "ema"]:
        """What the loop samples with: the sampling policy is ELBO_old's."""
        return self.old_policy

    def pairs_per_sample(self, num_steps: int) -> int:
        """P: estimator pairs per sample for a schedule of ``num_steps`` levels."""
        return max(1, int(num_steps * self.timestep_fraction)) * self.noise_draws


# -- the estimator and the objectives (pure functions) ----------------------------------------------------------
def elbo_estimate(v: Tensor, x0: Tensor, eps: Tensor, t: Tensor, weighting: Weighting) -> Tensor:
    """Per-sample ELBO (up to a constant) from the velocity ``v`` at ``x_t = (1 - t) x0 + t eps``: ``[B, ...]``
    tensors and ``t`` broadcastable to them -> ``[B]`` (fp32; formulas: module docstring)."""
    dims = tuple(range(1, v.ndim))
    if weighting == "velocity":
        return -((v - (eps - x0)) ** 2).mean(dim=dims)
    x_t = (1 - t) * x0 + t * eps
    d = (x_t - t * v) - x0
    if weighting == "x0":
        return -(d ** 2).mean(dim=dims)
    # the weight is detached and computed in fp64 (as the authors); floored so an exact prediction cannot divide by 0
    scale = d.detach().double().abs().mean(dim=dims, keepdim=True).clamp_min(1e-5).to(d.dtype)
    return -((d ** 2) / scale).mean(dim=dims)


def elbo_pg_per_entry(elbo_new: Tensor, elbo_old: Tensor, advantages: Tensor,
                      objective: Objective) -> tuple[Tensor, Tensor]:
    """Per-entry loss and ratio: ``[b]`` ELBOs (``elbo_new`` with grad), ``[b]`` advantages -> ``(loss, ratio)``."""
    log_ratio = elbo_new.detach() - elbo_old
    ratio = torch.exp(log_ratio)
    if objective == "epg":
        per = -(ratio * advantages * elbo_new)
    elif objective == "pepg":
        per = -(ratio * (advantages - log_ratio) * elbo_new)
    else:
        per = 0.5 * ratio * (advantages - (elbo_new - elbo_old)) ** 2
    return per, ratio


def estimator_draws(x_T: Tensor, num_levels: int, cfg: ELBOPGConfig) -> tuple[Tensor, Tensor]:
    """One sample's pairs: ``(levels [P] int64 indices into the schedule's sigmas, eps [P, C, h, w] fp32)``.

    ``x_T`` ``[C, h, w]`` is the sample's initial noise; the generator is seeded by ``cfg.seed`` and a blake2b hash
    of its bytes, on CPU, so any process and device draws the same pairs."""
    raw = x_T.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
    gen = torch.Generator(device="cpu").manual_seed(stable_seed(cfg.seed, "elbo_pg", digest))
    keep = max(1, int(num_levels * cfg.timestep_fraction))
    levels = torch.randperm(num_levels, generator=gen)[:keep].repeat_interleave(cfg.noise_draws)
    eps = torch.randn((len(levels), *x_T.shape), generator=gen, dtype=torch.float32)
    return levels, eps


@dataclass
class _Pair:
    """One estimator pair index j of one replay slice (each row its own level and eps)."""

    rows: slice
    col: int
    x0: Tensor
    eps: Tensor
    sigma: Tensor
    """[b] fp32 noise levels, on the policy's device."""
    conds: dict[str, Tensor]


class ELBOPolicyGradient:
    """``SteppedAlgorithm`` for diffusion Parts (``name: elbo_pg``); the policy must be a ``DiffusionBundle``."""

    def __init__(self, config: ELBOPGConfig | None = None) -> None:
        self.config = config or ELBOPGConfig()

    @property
    def old_policy(self) -> Literal["policy", "ema"]:
        """Weights the train backend evaluates ``old_log_probs`` (ELBO_old) under."""
        return self.config.old_policy

    # -- Algorithm ----------------------------------------------------------------------------
    @torch.no_grad()
    def old_log_probs(self, policy: Policy, micro_batch: SampleBatch) -> Tensor:
        """ELBO_old ``[B, P]`` (fp32, CPU) of this micro-batch's samples at their estimator pairs."""
        parts, segs, _ = _diffusion_parts(micro_batch)
        out = torch.zeros(len(parts), self._num_pairs(segs), dtype=torch.float32)
        for pr in self._pairs(policy, parts, segs):
            out[pr.rows, pr.col] = self._elbo(policy, pr)[0].cpu()
        return out

    def loss(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
             first_update: bool = False) -> LossOutput:
        """The micro-batch loss as one graph; the backend calls ``loss_terms`` instead."""
        return summed_loss(self.loss_terms(policy, micro_batch, old_log_probs=old_log_probs,
                                           first_update=first_update))

    def num_loss_terms(self, micro_batch: SampleBatch) -> int:
        _, segs, _ = _diffusion_parts(micro_batch)
        size = self.config.replay_batch_size or len(segs)
        return -(-len(segs) // size) * self._num_pairs(segs)

    def loss_terms(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
                   first_update: bool = False) -> Generator[Tensor, None, LossOutput]:
        """Yield one term per (replay slice, pair index); the terms add up to the mean loss over samples and pairs
        (+ ``kl_beta`` x the mean squared velocity gap to the reference)."""
        cfg = self.config
        parts, segs, _ = _diffusion_parts(micro_batch)
        num = self._num_pairs(segs)
        if old_log_probs is None:
            raise field_error(InvariantError, "old_log_probs (ELBO_old)", None, "ELBO_old from old_log_probs",
                              "set train.old_logp_source: replay (the trainer computes ELBO_old before the update)")
        if tuple(old_log_probs.shape) != (len(parts), num):
            raise field_error(InvariantError, "old_log_probs (ELBO_old).shape", tuple(old_log_probs.shape),
                              f"({len(parts)}, {num})", "pass the output of old_log_probs for exactly this micro-batch")
        adv = _advantages(parts) * cfg.advantage_scale
        if cfg.adv_clip_max is not None:
            adv = adv.clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
        count = float(len(parts) * num)
        new = torch.zeros_like(old_log_probs)
        sums = {"policy_loss": 0.0, "kl": 0.0}
        for pr in self._pairs(policy, parts, segs):
            elbo_new, v = self._elbo(policy, pr)
            old = old_log_probs[pr.rows, pr.col].to(elbo_new.device)
            per, _ = elbo_pg_per_entry(elbo_new, old, adv[pr.rows].to(elbo_new.device), cfg.objective)
            term = per.sum() / count
            sums["policy_loss"] += float(term.detach())
            if cfg.kl_beta > 0:
                with torch.no_grad(), policy.reference():
                    v_ref = self._velocity(policy, pr)
                kl = ((v - v_ref) ** 2).mean(dim=tuple(range(1, v.ndim))).sum() / count
                sums["kl"] += float(kl.detach())
                term = term + cfg.kl_beta * kl
            new[pr.rows, pr.col] = elbo_new.detach().cpu()
            yield term
        gap = (new - old_log_probs).abs()
        if first_update and cfg.old_policy == "policy":
            self._check_exact(gap)
        ratio = torch.exp(new - old_log_probs)
        total = sums["policy_loss"] + cfg.kl_beta * sums["kl"]
        metrics = {"loss": total, "policy_loss": sums["policy_loss"], "kl": sums["kl"],
                   "ratio_mean": float(ratio.mean()), "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
                   "elbo_mean": float(new.mean()), "elbo_old_mean": float(old_log_probs.mean()),
                   "elbo_absdiff_mean": float(gap.mean()), "elbo_absdiff_max": float(gap.max()),
                   "advantage_mean": float(adv.mean()), "trained_pairs": float(num), **staleness_metrics(micro_batch)}
        return LossOutput(loss=torch.tensor(total), metrics=metrics)

    # -- pieces -------------------------------------------------------------------------------
    def _num_pairs(self, segs: list[DiffusionSegment]) -> int:
        return self.config.pairs_per_sample(segs[0].sigmas.numel() - 1)

    def _check_exact(self, gap: Tensor) -> None:
        tol = self.config.elbo_tolerance
        worst = float(gap.max())
        if tol is not None and worst > tol:
            raise field_error(NumericsError, "first update: max |ELBO_theta - ELBO_old|", worst, f"<= {tol}",
                              "ELBO_old and the loss ran different numerics: keep replay_batch_size, dtype and "
                              "device the same between old_log_probs and the update")

    def _pairs(self, policy: Policy, parts: list[Part], segs: list[DiffusionSegment]) -> Iterator[_Pair]:
        if not hasattr(policy, "guided_velocity"):
            raise field_error(ConfigError, "policy", type(policy).__name__, "a DiffusionBundle (guided_velocity)",
                              "train ELBO-PG with unirl_core.models.diffusion.DiffusionBundle")
        device = policy.device
        size = self.config.replay_batch_size or len(parts)
        sig = segs[0].sigmas.float().cpu()
        # x0, eps and t are assembled on CPU in fp32 whatever device the trajectory sits on: the same bits in
        # old_log_probs and loss, on every device
        draws = [estimator_draws(s.latents[0], sig.numel() - 1, self.config) for s in segs]
        for lo in range(0, len(parts), size):
            rows = slice(lo, min(lo + size, len(parts)))
            chunk = range(rows.start, rows.stop)
            conds = stack_conditions([parts[i].conditions for i in chunk], device)
            x0 = torch.stack([segs[i].latents[-1] for i in chunk]).float().cpu()
            for col in range(len(draws[0][0])):
                eps = torch.stack([draws[i][1][col] for i in chunk])
                sigma = sig[torch.stack([draws[i][0][col] for i in chunk])]
                yield _Pair(rows=rows, col=col, x0=x0.to(device), eps=eps.to(device), sigma=sigma.to(device),
                            conds=conds)

    def _elbo(self, policy: Policy, pr: _Pair) -> tuple[Tensor, Tensor]:
        v = self._velocity(policy, pr)
        t = pr.sigma.view(-1, *([1] * (v.ndim - 1)))
        return elbo_estimate(v, pr.x0, pr.eps, t, self.config.weighting), v

    @staticmethod
    def _velocity(policy: Policy, pr: _Pair) -> Tensor:
        t = pr.sigma.view(-1, *([1] * (pr.x0.ndim - 1)))
        x_t = (1 - t) * pr.x0 + t * pr.eps
        # The conditional velocity: ELBO-PG trains without CFG whatever scale sampled the rollout.
        return policy.guided_velocity(x_t, pr.sigma, pr.conds, guidance_scale=1.0)


register_algorithm("elbo_pg", family="diffusion", config=ELBOPGConfig, build=ELBOPolicyGradient)
