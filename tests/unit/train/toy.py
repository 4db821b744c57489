"""A tiny Gaussian-transition policy and a clipped-surrogate algorithm whose log-prob replay is exact.

``latents[k+1] ~ N(latents[k] + f(latents[k]), sigma^2)`` with ``f = base(x) + lora(x)``: ``base`` is
frozen (like a pretrained model) and ``lora`` trainable, so the backend sees a LoRA-shaped parameter set.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from unirl_core.algorithms.base import LossOutput
from unirl_core.types import DiffusionSegment, Part, Sample, SampleBatch

DIM = 4  # latents are [T+1, 1, 2, 2]
SIGMA = 0.5


class ToyNet(nn.Module):
    def __init__(self, hidden: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Linear(hidden, DIM))
        self.lora = nn.Sequential(nn.Linear(DIM, hidden), nn.Dropout(dropout), nn.Tanh(), nn.Linear(hidden, DIM))
        self.base.requires_grad_(False)
        self.lora_enabled = True

    def forward(self, x: Tensor) -> Tensor:
        """x: [N, DIM] -> mean of the next state [N, DIM] (fp32; the layers run in the model dtype)."""
        h = x.to(self.base[0].weight.dtype)
        out = x + self.base(h).float()
        if self.lora_enabled:
            out = out + self.lora(h).float()
        return out


class ToyPolicy:
    def __init__(self, seed: int = 0, dropout: float = 0.0, hidden: int = 16) -> None:
        torch.manual_seed(seed)
        self._module = ToyNet(hidden, dropout)

    @property
    def module(self) -> nn.Module:
        return self._module

    @contextmanager
    def reference(self) -> Iterator[None]:
        self._module.lora_enabled = False
        try:
            yield
        finally:
            self._module.lora_enabled = True


def step_log_probs(module: nn.Module, latents: Tensor) -> Tensor:
    """latents: [B, T+1, DIM] -> per-step Gaussian log-probs [B, T] (float32)."""
    b, t1, _ = latents.shape
    x, nxt = latents[:, :-1].reshape(-1, DIM), latents[:, 1:].reshape(-1, DIM)
    mean = module(x).float()
    lp = -((nxt - mean) ** 2) / (2 * SIGMA**2) - math.log(SIGMA) - 0.5 * math.log(2 * math.pi)
    return lp.sum(-1).reshape(b, t1 - 1)


def _stack(batch: SampleBatch) -> tuple[Tensor, Tensor, Tensor]:
    segs = [p.segment for p in batch.generated]
    lat = torch.stack([s.latents.reshape(s.latents.shape[0], -1) for s in segs])
    old = torch.stack([s.log_probs for s in segs])
    adv = torch.tensor([p.advantage for p in batch.generated], dtype=torch.float32)
    return lat, old, adv


class ToyGRPO:
    """Per-step clipped surrogate ``-mean(min(r A, clip(r) A))``; records every call for the tests."""

    def __init__(self, clip: float = 0.2) -> None:
        self.clip = clip
        self.calls: list[tuple[str, list[str], bool]] = []

    def old_log_probs(self, policy: ToyPolicy, micro_batch: SampleBatch) -> Tensor:
        self.calls.append(("old", [s.sample_id for s in micro_batch], torch.is_grad_enabled()))
        lat, _, _ = _stack(micro_batch)
        return step_log_probs(policy.module, lat)

    def loss(self, policy: ToyPolicy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
             first_update: bool = False) -> LossOutput:
        self.calls.append(("loss", [s.sample_id for s in micro_batch], old_log_probs is not None))
        lat, stored, adv = _stack(micro_batch)
        old = stored if old_log_probs is None else old_log_probs
        new = step_log_probs(policy.module, lat)
        ratio = torch.exp(new - old)
        a = adv[:, None]
        surr = torch.minimum(ratio * a, ratio.clamp(1 - self.clip, 1 + self.clip) * a)
        loss = -surr.mean()
        with torch.no_grad():
            metrics = {"ratio_mean": float(ratio.mean()), "ratio_min": float(ratio.min()),
                       "ratio_max": float(ratio.max()),
                       "clip_frac": float(((ratio - 1).abs() > self.clip).float().mean())}
        return LossOutput(loss=loss, metrics=metrics)


@torch.no_grad()
def rollout(policy: ToyPolicy, n: int, steps: int = 3, seed: int = 0) -> SampleBatch:
    """Sample n trajectories with the current weights; log-probs recorded per sample (batch of 1)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        x = torch.randn(1, DIM, generator=g)
        states = [x]
        for _ in range(steps):
            x = policy.module(x) + SIGMA * torch.randn(1, DIM, generator=g)
            states.append(x)
        lat = torch.cat(states).reshape(steps + 1, 1, 2, 2)
        lp = step_log_probs(policy.module, lat.reshape(1, steps + 1, DIM))[0]
        seg = DiffusionSegment(latents=lat, log_probs=lp.float(), sigmas=torch.linspace(1, 0, steps + 1),
                               sde_mask=torch.ones(steps, dtype=torch.bool))
        gid = f"p{i // 2}"
        part = Part(kind="diffusion", sample_id=f"s{i}", group_id=gid, segment=seg,
                    advantage=float(torch.randn((), generator=g)))
        samples.append(Sample(sample_id=f"s{i}", group_id=gid, parts=[part]))
    return SampleBatch(samples=samples)
