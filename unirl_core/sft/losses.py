"""SFT losses: pure functions (golden-tested) and the two ``Algorithm`` adapters the train backend drives.

Diffusion (rectified flow): for an encoded image x0 ``[B, C, h, w]``, noise eps ~ N(0, I) and a per-sample
sigma in (0, 1), ``x_sigma = (1 - sigma) x0 + sigma eps``; the transformer's velocity at ``x_sigma`` is
regressed onto ``eps - x0`` (mean squared error). The sampler integrates ``dx/dsigma = v`` from sigma 1 to 0,
which is exactly what the rollout engine does with this velocity.

LM: mean token cross-entropy of the completion tokens given the prompt (prompt tokens are context only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from unirl_core.algorithms.base import LossOutput
from unirl_core.errors import ConfigError, InvariantError, field_error
from unirl_core.models.lm import build_layout, replay_log_probs
from unirl_core.sde.noise import stable_seed
from unirl_core.sft.config import FlowMatchingConfig
from unirl_core.types import SampleBatch

TARGET_IMAGE = "target_image"
"""Condition key of a supervised diffusion Part: the record's image, uint8 ``[3, H, W]``."""


# ----------------------------------------------------------------------------------- pure functions

def sample_sigmas(u: Tensor, cfg: FlowMatchingConfig) -> Tensor:
    """Map uniforms ``u`` in (0, 1) ``[B]`` (or standard normals for ``logit_normal``) to sigmas ``[B]`` fp32.

    ``logit_normal``: ``sigmoid(logit_mean + logit_std * u)`` with ``u`` a standard normal draw;
    ``uniform``: ``u`` itself. Callers draw ``u`` with their own generator (see ``draw_noise``).
    """
    if cfg.sigma_sampling == "logit_normal":
        return torch.sigmoid(cfg.logit_mean + cfg.logit_std * u.float())
    return u.float()


def flow_matching_pair(x0: Tensor, eps: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_sigma, target)``: ``x_sigma = (1 - sigma) x0 + sigma eps`` and ``target = eps - x0``.

    ``x0``, ``eps`` ``[B, C, h, w]`` fp32, ``sigma`` ``[B]``."""
    s = sigma.float().view(-1, *([1] * (x0.ndim - 1)))
    return (1.0 - s) * x0 + s * eps, eps - x0


def flow_matching_loss(velocity: Tensor, target: Tensor) -> Tensor:
    """Mean squared error over every element (fp32); equal weight per sample when all images share a shape."""
    return (velocity.float() - target.float()).pow(2).mean()


def completion_nll(log_probs: Tensor, mask: Tensor) -> Tensor:
    """Mean negative log-likelihood over the masked tokens: ``-sum(logp * mask) / sum(mask)``.

    ``log_probs`` ``[B, R]`` fp32, ``mask`` ``[B, R]`` bool (True on completion tokens)."""
    n = mask.sum()
    if int(n) == 0:
        raise field_error(InvariantError, "completion tokens", 0, ">= 1 token in the micro-batch",
                          "drop records with empty completions")
    return -(log_probs * mask).sum() / n


def draw_noise(sample_ids: list[str], seed: int, shape: tuple[int, ...], cfg: FlowMatchingConfig
               ) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample, order-independent draws ``(eps [B, *shape], sigma [B], keep_caption [B] bool)`` on CPU fp32.

    Each sample's generator is seeded by ``stable_seed(seed, sample_id)``; sample ids carry the step, so a
    resumed run draws exactly what the uninterrupted run drew, whatever the micro-batch slicing."""
    eps, u, keep = [], [], []
    for sid in sample_ids:
        g = torch.Generator().manual_seed(stable_seed(seed, "sft", sid))
        eps.append(torch.randn(shape, generator=g))
        draw = torch.randn(1, generator=g) if cfg.sigma_sampling == "logit_normal" else torch.rand(1, generator=g)
        u.append(draw.clamp(1e-6, 1 - 1e-6) if cfg.sigma_sampling == "uniform" else draw)
        keep.append(bool(torch.rand(1, generator=g).item() >= cfg.caption_dropout))
    return torch.stack(eps), sample_sigmas(torch.cat(u), cfg), torch.tensor(keep)


# ----------------------------------------------------------------------------------- algorithm adapters

class _NoReplay:
    """SFT has no pi_old: the backend asks for it only with ``old_logp_source='replay'``, which SFTConfig refuses."""

    def old_log_probs(self, policy, micro_batch: SampleBatch) -> Tensor:
        raise field_error(ConfigError, "train.old_logp_source", "replay", "'rollout' for SFT",
                          "SFT has no sampled log-probs to replay; remove the field")


class FlowMatchingSFT(_NoReplay):
    """Rectified-flow loss over supervised diffusion Parts (``conditions['target_image']`` + ``prompt``)."""

    def __init__(self, cfg: FlowMatchingConfig, *, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def loss(self, policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
             first_update: bool = False) -> LossOutput:
        parts = micro_batch.generated
        x0 = encode_images(policy, torch.stack([p.conditions[TARGET_IMAGE] for p in parts]))
        ids = [s.sample_id for s in micro_batch.samples]
        eps, sigma, keep = draw_noise(ids, self.seed, tuple(x0.shape[1:]), self.cfg)
        x_sigma, target = flow_matching_pair(x0, eps.to(x0.device), sigma.to(x0.device))
        captions = [p.prompt if k else "" for p, k in zip(parts, keep.tolist())]
        from unirl_core.models.diffusion import stack_conditions

        conds = stack_conditions(policy.encode_text(captions), policy.device)
        v = policy.velocity(x_sigma.to(policy.dtype), sigma.to(policy.device), conds)
        loss = flow_matching_loss(v, target)
        return LossOutput(loss=loss, metrics={"sigma_mean": float(sigma.mean()),
                                              "caption_dropped": float((~keep).float().mean())})


@torch.no_grad()
def encode_images(policy, images: Tensor) -> Tensor:
    """uint8 ``[B, 3, H, W]`` -> the flow's x0 ``[B, C, h, w]`` fp32: VAE latent mean, shifted and scaled as the
    pipeline's decode undoes it (``(z - shift) * scaling``). The mean, not a sample: the target is deterministic."""
    vae = policy.pipeline.vae
    if vae is None:
        raise field_error(ConfigError, "bundle", "transformer-only", "a bundle with a VAE to encode target images",
                          "build the bundle with DiffusionBundle.build(...)")
    x = images.to(device=policy.device, dtype=vae.dtype) / 127.5 - 1.0
    z = vae.encode(x).latent_dist.mean.float()
    shift = vae.config.shift_factor or 0.0
    return (z - shift) * vae.config.scaling_factor


class CompletionSFT(_NoReplay):
    """Token cross-entropy of supervised AR Parts (``TokenSegment``: prompt ids + completion ids)."""

    def loss(self, policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
             first_update: bool = False) -> LossOutput:
        segs = [p.segment for p in micro_batch.generated]
        device = next(policy.module.parameters()).device
        layout = build_layout(segs, [1.0] * len(segs), pad_id=policy.pad_token_id, device=device)
        logp, _ = replay_log_probs(policy.module, layout, chunk_tokens=policy.logprob_chunk_tokens)
        loss = completion_nll(logp, layout.loss_mask)
        return LossOutput(loss=loss, metrics={"tokens": float(layout.loss_mask.sum())})
