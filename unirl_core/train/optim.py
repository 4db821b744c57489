"""AdamW over the trainable parameters and its warmup + decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from unirl_core.errors import ConfigError, field_error
from unirl_core.train.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``cfg.lr`` for the optimizer step with index ``step`` (0 = the first update).

    Linear warmup ``(step + 1) / warmup_steps``, then ``constant`` 1, or a ``cosine`` / ``linear`` decay
    from 1 to ``min_lr_ratio`` reached at ``total_steps`` and held afterwards.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    assert cfg.total_steps is not None  # TrainConfig validates this for decaying schedules
    span = cfg.total_steps - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters with ``requires_grad`` in module order; raises when there are none."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise field_error(ConfigError, "policy.module", type(module).__name__, "at least one trainable parameter",
                          "attach LoRA adapters or unfreeze the weights before building the backend")
    return named


def optimizer_impl(params: list[nn.Parameter], cfg: TrainConfig) -> str:
    """``train.optimizer_impl`` resolved for these parameters: ``auto`` is ``fused`` when all are on CUDA."""
    if cfg.optimizer_impl != "auto":
        return cfg.optimizer_impl
    return "fused" if params and all(p.device.type == "cuda" for p in params) else "foreach"


def build_optimizer(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with the config's hyper-parameters, its kernel as :func:`optimizer_impl` picks it."""
    fused = optimizer_impl(params, cfg) == "fused"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             foreach=None if fused else True, fused=True if fused else None)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`lr_factor`; its state is just the step index, so it resumes exactly."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
