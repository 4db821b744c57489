"""Flow-GRPO: clipped per-step surrogate over replayed SDE log-probs, with an optional KL to a reference.

Replay runs ``unirl_core.sde.trajectory.denoise_step`` on the stored trajectory - the same function,
inputs and batch slicing as the trainside rollout - so on the first update log-probs equal the
stored ones bit for bit (ratio exactly 1). Shapes: B samples in the micro-batch, T steps, S the
trained steps (SDE steps of the micro-batch, optionally a ``timestep_fraction`` of them).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from unirl_core.algorithms.base import LossOutput, OldLogpSource, Policy, summed_loss
from unirl_core.algorithms.off_policy import behaviour_weights, check_is_config, fresh_rows, staleness_metrics
from unirl_core.algorithms.registry import register_algorithm
from unirl_core.errors import ConfigError, InvariantError, NumericsError, field_error
from unirl_core.models.diffusion import stack_conditions
from unirl_core.sde.kernels import schedule_coefficients
from unirl_core.sde.noise import stable_seed
from unirl_core.sde.trajectory import denoise_step
from unirl_core.sde.window import select_train_steps
from unirl_core.types import DiffusionSamplingParams, DiffusionSegment, Part, SampleBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FlowGRPOConfig:
    """Flow-GRPO loss settings."""

    name: Literal["flow_grpo"] = field(default="flow_grpo", init=False)
    """Registry name (the default of the diffusion section)."""
    clip_range: float = 1e-4
    """PPO clip epsilon on the per-step ratio (Flow-GRPO uses 1e-4: per-step ratios stay very close to 1)."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to [-adv_clip_max, adv_clip_max]."""
    kl_beta: float = 0.0
    """Weight of the KL to the reference policy (LoRA off / frozen copy); 0 skips the reference forward."""
    timestep_fraction: float = 1.0
    """Fraction of the micro-batch's SDE steps to train (a seeded subset, the same for pi_old and the loss)."""
    old_logp_source: OldLogpSource = "rollout"
    """``rollout``: pi_old = the stored log-probs; ``replay``: the backend recomputes them with ``old_log_probs``.

    The train backend acts on its own ``train.old_logp_source``; this field declares what the loss
    expects and the run config requires the two to agree."""
    replay_batch_size: int | None = None
    """Samples per replay forward; set it to the engine's ``forward_batch_size`` for exact replay. None: whole micro-batch."""
    logp_tolerance: float | None = 1e-3
    """Fail closed when max |logp_rollout - logp_replay| exceeds this (checked wherever pi_old is replayed); None disables."""
    seed: int = 0
    """Seed of the ``timestep_fraction`` subset."""
    cfg_grad: Literal["cond", "both"] = "cond"
    """Which CFG branch carries gradient in the loss: ``cond`` stops it at the unconditional branch (the public
    Flow-GRPO training loop, ``scripts/train_sd3.py``'s ``compute_log_prob``, detaches it), ``both`` lets it
    flow through both (that repository's earliest versions). Forward values, hence log-probs and ratios, are
    the same bits either way."""

    tis_cap: float | None = None
    """Off-policy correction for lagged rollouts (needs ``old_logp_source: replay``): each trained step's loss is
    weighted by ``min(pi_old / pi_behav, C)`` of that step's transition (detached), pi_behav the log-prob recorded
    at rollout: its own clip, apart from ``clip_range`` (which bounds ``pi_theta / pi_old``). None: off."""

    def __post_init__(self) -> None:
        check_is_config("flow_grpo", "token", self.tis_cap, None)
        if not (self.clip_range > 0):
            raise field_error(ConfigError, "flow_grpo.clip_range", self.clip_range, "a value > 0", "use e.g. 1e-4")
        if not (self.adv_clip_max > 0):
            raise field_error(ConfigError, "flow_grpo.adv_clip_max", self.adv_clip_max, "a value > 0", "use e.g. 5.0")
        if not (self.kl_beta >= 0):
            raise field_error(ConfigError, "flow_grpo.kl_beta", self.kl_beta, "a value >= 0", "use 0.0 to disable KL")
        if not (0 < self.timestep_fraction <= 1):
            raise field_error(ConfigError, "flow_grpo.timestep_fraction", self.timestep_fraction, "a value in (0, 1]",
                              "use 1.0 to train every SDE step")
        if self.old_logp_source not in ("rollout", "replay"):
            raise field_error(ConfigError, "flow_grpo.old_logp_source", self.old_logp_source, "'rollout' or 'replay'",
                              "use 'replay' when train micro-batches differ from the rollout slices")
        if self.replay_batch_size is not None and not (isinstance(self.replay_batch_size, int) and self.replay_batch_size >= 1):
            raise field_error(ConfigError, "flow_grpo.replay_batch_size", self.replay_batch_size, "None or an integer >= 1",
                              "match the engine's forward_batch_size")
        if self.cfg_grad not in ("cond", "both"):
            raise field_error(ConfigError, "flow_grpo.cfg_grad", self.cfg_grad, "'cond' or 'both'",
                              "use 'cond' (the reference's choice)")
        if self.logp_tolerance is not None and not (self.logp_tolerance >= 0):
            raise field_error(ConfigError, "flow_grpo.logp_tolerance", self.logp_tolerance, "None or a value >= 0",
                              "use e.g. 1e-3")


def surrogate_per_entry(new_logp: Tensor, old_logp: Tensor, advantages: Tensor, *, clip_range: float,
                        adv_clip_max: float) -> tuple[Tensor, Tensor]:
    """PPO-clip loss of each entry: ``max(-A r, -A clip(r, 1-eps, 1+eps))`` with ``A`` clamped.

    ``new_logp`` / ``old_logp`` ``[B, S]`` (or ``[B]``), ``advantages`` ``[B]``; returns ``(per_entry, ratio)``.
    """
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    if new_logp.ndim == 2:
        adv = adv[:, None]
    ratio = torch.exp(new_logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def clipped_surrogate(new_logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_range: float,
                      adv_clip_max: float) -> tuple[Tensor, Tensor]:
    """PPO-clip loss per trained entry, averaged over ``mask``. ``[B, S]`` log-probs, ``[B]`` advantages.

    Returns ``(loss, ratio)``; ``loss = mean(max(-A r, -A clip(r, 1-eps, 1+eps)))`` with ``A`` clamped.
    """
    per, ratio = surrogate_per_entry(new_logp, old_logp, advantages, clip_range=clip_range, adv_clip_max=adv_clip_max)
    return masked_mean(per, mask), ratio


def gaussian_kl_same_std(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """KL(N(mean, std^2) || N(ref_mean, std^2)) per element, averaged over latent dims: ``[B, ...] -> [B]``."""
    d = (mean - ref_mean) ** 2
    return d.mean(dim=tuple(range(1, d.ndim))) / (2 * std.reshape(-1) ** 2)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


@dataclass
class _StepReplay:
    """One trained step of one replay slice."""

    rows: slice
    """Rows of the micro-batch in this replay slice."""
    col: int
    """Index of the step among the trained steps S."""
    log_prob: Tensor
    """[b] fp32 log-probs, with grad when grad is enabled."""
    kl: Tensor | None
    """[b] fp32 KL to the reference (None without KL)."""
    mean: Tensor | None = None
    """[b, C, h, w] fp32 mean of the replayed transition (with grad when grad is enabled)."""
    std: Tensor | None = None
    """fp32 std of the transition, broadcastable to ``mean``."""
    step: int = -1
    """Index k of the denoising step (``steps[col]``)."""


class FlowGRPO:
    """``Algorithm`` for diffusion Parts; the policy must be a ``DiffusionBundle``-like object."""

    def __init__(self, config: FlowGRPOConfig | None = None) -> None:
        self.config = config or FlowGRPOConfig()

    # -- Algorithm ----------------------------------------------------------------------------
    @torch.no_grad()
    def old_log_probs(self, policy: Policy, micro_batch: SampleBatch) -> Tensor:
        """``[B, T]`` pi_old log-probs replayed over exactly this micro-batch (0 off the trained steps)."""
        parts, segs, sampling = _diffusion_parts(micro_batch)
        steps = self._train_steps(micro_batch, segs)
        full = torch.zeros(len(parts), sampling.num_steps, dtype=torch.float32)
        for rep in self._replay_steps(policy, parts, segs, sampling, steps, with_kl=False):
            full[rep.rows, steps[rep.col]] = rep.log_prob.cpu()
        stored = torch.stack([s.log_probs for s in segs])
        self._check_logp(stored[:, steps], full[:, steps], _fresh_mask(micro_batch, segs, steps), where="old_log_probs")
        return full

    def loss(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
             first_update: bool = False) -> LossOutput:
        """The micro-batch loss as one graph (every trained step's graph alive until backward). The train
        backend calls ``loss_terms`` instead and back-propagates one step at a time."""
        return summed_loss(self.loss_terms(policy, micro_batch, old_log_probs=old_log_probs,
                                           first_update=first_update))

    def num_loss_terms(self, micro_batch: SampleBatch) -> int:
        """How many terms ``loss_terms`` yields for this micro-batch: replay slices x trained steps."""
        _, segs, _ = _diffusion_parts(micro_batch)
        size = self.config.replay_batch_size or len(segs)
        return -(-len(segs) // size) * len(self._train_steps(micro_batch, segs))

    def loss_terms(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
                   first_update: bool = False) -> Generator[Tensor, None, LossOutput]:
        """Yield the micro-batch loss one trained step (of one replay slice) at a time; return its metrics.

        Each yielded scalar is that step's share of ``mean over trained entries (policy loss) + kl_beta * KL``,
        so the terms add up to the loss; back-propagating each as it comes keeps one step's graph alive
        instead of all of them. The returned ``LossOutput.loss`` is the detached total.
        """
        cfg = self.config
        parts, segs, sampling = _diffusion_parts(micro_batch)
        steps = self._train_steps(micro_batch, segs)
        if not steps:
            raise field_error(InvariantError, "micro_batch.sde_mask", "no SDE step", "at least one SDE step",
                              "sample with noise_level > 0 and a stochastic sde_type")
        mask = _mask(segs, steps)  # [B, S] bool, CPU
        count = float(mask.sum().clamp_min(1))
        adv = _advantages(parts)
        stored = torch.stack([s.log_probs for s in segs])[:, steps]
        old = stored if old_log_probs is None else old_log_probs[:, steps].cpu()
        if old_log_probs is not None:
            self._check_logp(stored, old, _fresh_mask(micro_batch, segs, steps), where="loss(old_log_probs)")
        # behaviour weight [B, S]: pi_old (replayed) over the recorded pi_behav; 1 when off or on-policy
        weight = torch.ones_like(stored)
        if cfg.tis_cap is not None and old_log_probs is not None:
            weight, _, _ = behaviour_weights(old, stored, mask, level="token", tis_cap=cfg.tis_cap, mis_bounds=None)
        # Detached per-entry records stay on the device until the end: no host sync between steps, so the
        # backend's backward of one step and the next step's forward queue back to back.
        rec: dict[str, Tensor] = {}
        policy_parts: list[Tensor] = []
        kl_parts: list[Tensor] = []
        for rep in self._replay_steps(policy, parts, segs, sampling, steps, with_kl=cfg.kl_beta > 0):
            dev = rep.log_prob.device
            if not rec:
                rec = {"new": stored.to(dev).clone(), "ratio": torch.ones_like(stored, device=dev),
                       "kl": torch.zeros_like(stored, device=dev), "mask": mask.to(dev), "old": old.to(dev),
                       "adv": adv.to(dev), "weight": weight.to(dev)}
            m = rec["mask"][rep.rows, rep.col]
            per, r = self.step_surrogate(rep, rec["old"][rep.rows, rep.col], rec["adv"][rep.rows], m)
            if cfg.tis_cap is not None:
                per = per * rec["weight"][rep.rows, rep.col]
            policy_term = (per * m).sum() / count
            term, kl_term = policy_term, None
            if rep.kl is not None:
                kl_term = (rep.kl * m).sum() / count
                term = term + cfg.kl_beta * kl_term
                rec["kl"][rep.rows, rep.col] = rep.kl.detach()
            rec["new"][rep.rows, rep.col] = rep.log_prob.detach()
            rec["ratio"][rep.rows, rep.col] = r.detach()
            policy_parts.append(policy_term.detach())
            if kl_term is not None:
                kl_parts.append(kl_term.detach())
            yield term
        policy_sum = float(torch.stack(policy_parts).sum())
        kl_sum = float(torch.stack(kl_parts).sum()) if kl_parts else 0.0
        new = rec["new"].cpu()
        # pi_old as replayed: the given tensor, else the current forward (equal to pi_old on the first update)
        replayed = old if old_log_probs is not None else new
        if old_log_probs is None and first_update:
            self._check_logp(stored, new, mask, where="first update")
        total = policy_sum + cfg.kl_beta * kl_sum if cfg.kl_beta > 0 else policy_sum
        sel = mask.bool()
        r, absdiff = rec["ratio"].cpu()[sel], (stored - replayed).abs()[sel]
        metrics = {
            "loss": total, "policy_loss": policy_sum,
            "ratio_mean": float(r.mean()), "ratio_min": float(r.min()), "ratio_max": float(r.max()),
            "clip_frac": float(((r - 1).abs() > cfg.clip_range).float().mean()),
            "kl": float(masked_mean(rec["kl"].cpu(), mask)),
            "logp_absdiff_mean": float(absdiff.mean()), "logp_absdiff_max": float(absdiff.max()),
            "advantage_mean": float(adv.mean()), "trained_steps": float(len(steps)),
            **staleness_metrics(micro_batch),
        }
        if cfg.tis_cap is not None:
            w = weight[sel]
            metrics.update({"is_weight_mean": float(w.mean()),
                            "is_truncated_frac": float((w >= cfg.tis_cap).float().mean())})
        return LossOutput(loss=torch.tensor(total), metrics=metrics)

    # -- pieces -------------------------------------------------------------------------------
    def step_surrogate(self, rep: _StepReplay, old_logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Per-entry policy loss ``[b]`` and ratio ``[b]`` of one replayed step (``mask``: its trained entries).
        Variants that change only the surrogate (GRPO-Guard, Flow-DPPO) override this."""
        return surrogate_per_entry(rep.log_prob, old_logp, adv, clip_range=self.config.clip_range,
                                   adv_clip_max=self.config.adv_clip_max)

    def _train_steps(self, micro_batch: SampleBatch, segs: list[DiffusionSegment]) -> list[int]:
        mask = torch.stack([s.sde_mask for s in segs])
        gen = torch.Generator().manual_seed(stable_seed(self.config.seed, *[s.sample_id for s in micro_batch.samples]))
        return select_train_steps(mask, fraction=self.config.timestep_fraction, generator=gen)

    def _check_logp(self, stored: Tensor, replayed: Tensor, mask: Tensor, *, where: str) -> None:
        tol = self.config.logp_tolerance
        if tol is None or not bool(mask.any()):
            return
        diff = (stored.to(replayed.device) - replayed).abs()[mask.to(replayed.device).bool()]
        worst = float(diff.max())
        if worst > tol:
            raise field_error(NumericsError, f"{where}: max |logp_rollout - logp_replay|", worst, f"<= {tol}",
                              "rollout and replay ran different numerics: match replay_batch_size to the engine's "
                              "forward_batch_size, keep the same dtype and CFG, and check sigma_verify")

    def _replay_steps(self, policy: Policy, parts: list[Part], segs: list[DiffusionSegment],
                      sampling: DiffusionSamplingParams, steps: list[int], *, with_kl: bool) -> Iterator[_StepReplay]:
        """Replay every trained step of every slice of ``replay_batch_size`` samples, one at a time (the same
        ``denoise_step`` as the rollout, on the same slices)."""
        if not hasattr(policy, "guided_velocity"):
            raise field_error(ConfigError, "policy", type(policy).__name__, "a DiffusionBundle (guided_velocity)",
                              "train Flow-GRPO with unirl_core.models.diffusion.DiffusionBundle")
        device = policy.device
        size = self.config.replay_batch_size or len(parts)
        sig = segs[0].sigmas.to(device)
        coefs = schedule_coefficients(sampling.sde_type, sig, noise_level=sampling.noise_level)
        for lo in range(0, len(parts), size):
            rows = slice(lo, min(lo + size, len(parts)))
            chunk = range(rows.start, rows.stop)
            conds = policy.prepare_cfg(stack_conditions([parts[i].conditions for i in chunk], device),
                                       guidance_scale=sampling.guidance_scale)
            lat = torch.stack([segs[i].latents for i in chunk]).to(device)
            smask = torch.stack([segs[i].sde_mask for i in chunk])  # stays on CPU (see transition)

            def vel(x: Tensor, sigma: Tensor, conds=conds) -> Tensor:
                return policy.guided_velocity(x, sigma, conds, guidance_scale=sampling.guidance_scale,
                                              uncond_grad=self.config.cfg_grad == "both")

            for col, k in enumerate(steps):
                kw = dict(sde_type=sampling.sde_type, noise_level=sampling.noise_level, sde_mask_k=smask[:, k],
                          trajectory_dtype=lat.dtype, prev_sample=lat[:, k + 1], coefficients=coefs)
                out = denoise_step(vel, lat[:, k].float(), k, sig, **kw)
                kl = None
                if with_kl:
                    with torch.no_grad(), policy.reference():
                        ref = denoise_step(vel, lat[:, k].float(), k, sig, **kw)
                    safe = torch.where(out.std > 0, out.std, torch.ones_like(out.std)).expand(len(chunk), 1, 1, 1)
                    kl = torch.where(smask[:, k].to(device), gaussian_kl_same_std(out.mean, ref.mean, safe),
                                     torch.zeros((), device=device))
                yield _StepReplay(rows=rows, col=col, log_prob=out.log_prob, kl=kl, mean=out.mean, std=out.std, step=k)


def _diffusion_parts(batch: SampleBatch) -> tuple[list[Part], list[DiffusionSegment], DiffusionSamplingParams]:
    if not len(batch):
        raise field_error(InvariantError, "micro_batch", 0, "at least one sample", "drop empty micro-batches")
    parts = batch.generated
    segs, first = [], None
    for s, p in zip(batch.samples, parts):
        if p.kind != "diffusion" or not isinstance(p.segment, DiffusionSegment):
            raise field_error(InvariantError, f"sample[{s.sample_id}].segment", type(p.segment).__name__,
                              "a filled DiffusionSegment", "run the diffusion rollout before training")
        first = first or p.sampling
        same = (p.sampling.sigmas, p.sampling.sde_type, p.sampling.noise_level, p.sampling.guidance_scale) == (
            first.sigmas, first.sde_type, first.noise_level, first.guidance_scale)
        if not same:
            raise field_error(InvariantError, f"sample[{s.sample_id}].sampling", p.sampling,
                              "the schedule, kernel, noise level and CFG scale of the micro-batch's first sample",
                              "build micro-batches from samples rolled out with the same sampling params")
        segs.append(p.segment)
    return parts, segs, first


def _mask(segs: list[DiffusionSegment], steps: list[int]) -> Tensor:
    return torch.stack([s.sde_mask for s in segs])[:, steps]


def _fresh_mask(batch: SampleBatch, segs: list[DiffusionSegment], steps: list[int]) -> Tensor:
    """``_mask`` restricted to rows sampled by the trainer's current weights: only they can be held to the
    rollout-vs-replay tolerance (a stale row's gap is the policy's drift)."""
    return _mask(segs, steps) & fresh_rows(batch)[:, None]


def _advantages(parts: list[Part]) -> Tensor:
    missing = [p.sample_id for p in parts if p.advantage is None]
    if missing:
        raise field_error(InvariantError, "part.advantage", missing[:5], "a float on every trained Part",
                          "run the advantage phase before training")
    return torch.tensor([p.advantage for p in parts], dtype=torch.float32)



register_algorithm("flow_grpo", family="diffusion", config=FlowGRPOConfig, build=FlowGRPO)
