"""Encoded stage outputs carried by a generated Part.

Shapes use T = denoising steps, C/H/W = latent channels/height/width, P = prompt tokens,
R = response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from unirl_core.errors import InvariantError, field_error

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


def _check(cond: bool, field: str, value: object, expected: str, fix: str) -> None:
    if not cond:
        raise field_error(InvariantError, field, value, expected, fix)


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


@dataclass(kw_only=True, eq=False)
class DiffusionSegment:
    """One denoising trajectory.

    ``latents[k]`` is the state before step k (``latents[0]`` = x_T, ``latents[T]`` = x_0);
    ``log_probs[k]`` is log p(latents[k+1] | latents[k]) for SDE steps (0 on ODE steps);
    ``sigmas`` are the sigmas the engine actually used; ``sde_mask[k]`` marks SDE steps.
    """

    latents: Tensor
    """[T+1, C, H, W] trajectory, in the trajectory dtype (fp32 or bf16)."""
    log_probs: Tensor
    """[T] float32 per-step log-probs (0 where ``sde_mask`` is False)."""
    sigmas: Tensor
    """[T+1] float32 sigmas echoed by the engine."""
    sde_mask: Tensor
    """[T] bool, True where the step was stochastic and carries a log-prob."""

    def __post_init__(self) -> None:
        lat = self.latents
        _check(isinstance(lat, Tensor) and lat.ndim == 4 and lat.shape[0] >= 2, "segment.latents", _shape(lat),
               "a [T+1, C, H, W] tensor with T >= 1", "store every intermediate latent, x_T first")
        t = lat.shape[0] - 1
        _check(isinstance(self.log_probs, Tensor) and tuple(self.log_probs.shape) == (t,), "segment.log_probs",
               _shape(self.log_probs), f"shape ({t},) to match latents", "record one log-prob per step")
        _check(self.log_probs.dtype == torch.float32, "segment.log_probs.dtype", self.log_probs.dtype,
               "torch.float32", "compute log-probs in fp32")
        _check(isinstance(self.sigmas, Tensor) and tuple(self.sigmas.shape) == (t + 1,), "segment.sigmas",
               _shape(self.sigmas), f"shape ({t + 1},)", "echo the sigmas the engine used, including the final 0")
        _check(self.sigmas.dtype == torch.float32, "segment.sigmas.dtype", self.sigmas.dtype, "torch.float32",
               "echo sigmas as float32")
        _check(isinstance(self.sde_mask, Tensor) and tuple(self.sde_mask.shape) == (t,)
               and self.sde_mask.dtype == torch.bool, "segment.sde_mask",
               (_shape(self.sde_mask), getattr(self.sde_mask, "dtype", None)), f"a bool tensor of shape ({t},)",
               "mark which steps were SDE steps")

    @property
    def num_steps(self) -> int:
        return self.latents.shape[0] - 1


@dataclass(kw_only=True, eq=False)
class TokenSegment:
    """One sampled completion with the per-token log-probs of the sampled tokens."""

    prompt_ids: Tensor
    """[P] int64 prompt token ids (no padding)."""
    response_ids: Tensor
    """[R] int64 sampled token ids (no padding; includes the EOS token when one was sampled)."""
    log_probs: Tensor
    """[R] float32 log-probs of ``response_ids`` under the temperature-scaled sampling distribution."""
    response_mask: Tensor
    """[R] bool, True for tokens that enter the loss (False for e.g. tool output in agentic turns)."""
    finish_reason: FinishReason = "length"
    """Why generation stopped: ``stop`` (EOS or stop string), ``length`` (max tokens), ``abort``."""

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "response_ids"):
            v = getattr(self, name)
            _check(isinstance(v, Tensor) and v.ndim == 1 and v.dtype == torch.int64, f"segment.{name}",
                   (_shape(v), getattr(v, "dtype", None)), "a 1-D int64 tensor", "store unpadded token ids")
        r = self.response_ids.shape[0]
        _check(isinstance(self.log_probs, Tensor) and tuple(self.log_probs.shape) == (r,)
               and self.log_probs.dtype == torch.float32, "segment.log_probs",
               (_shape(self.log_probs), getattr(self.log_probs, "dtype", None)),
               f"a float32 tensor of shape ({r},) to match response_ids", "record one log-prob per sampled token")
        _check(isinstance(self.response_mask, Tensor) and tuple(self.response_mask.shape) == (r,)
               and self.response_mask.dtype == torch.bool, "segment.response_mask",
               (_shape(self.response_mask), getattr(self.response_mask, "dtype", None)),
               f"a bool tensor of shape ({r},)", "mark the tokens that enter the loss")
        _check(self.finish_reason in FINISH_REASONS, "segment.finish_reason", self.finish_reason,
               f"one of {FINISH_REASONS}", "report why generation stopped")

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.shape[0])


Segment = DiffusionSegment | TokenSegment
