"""Engine-vs-replay log-prob agreement: the metric logged every step and the fail-closed check.

A dedicated engine (vLLM, SGLang) computes the sampled tokens' log-probs with its own kernels,
dtype and batching; the trainer replays them with a transformers forward. The two never agree
bit for bit, but they must agree closely, or the GRPO ratio (and the TIS weight
``exp(logp_old - logp_rollout)``) measures engine drift instead of policy change. Typical sizes on
the tiny test model (tests/integration/test_vllm_engine.py): vLLM fp32 on CPU vs a fp32 replay
~1e-6 max; a bf16 server ~4e-3 max, ~1e-3 mean; rollouts replayed under other weights ~0.9 max,
~0.24 mean.

Shapes: ``[B, R]`` (B sequences, R = longest response), with a bool mask of real loss tokens.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, InvariantError, NumericsError, field_error
from unirl_core.types import ARSamplingParams, SampleBatch, TokenSegment

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class LogpCheckConfig:
    """Thresholds of the agreement check (None disables that bound)."""

    max_abs_diff: float | None = 1.0
    """Fail when max |logp_engine - logp_replay| over loss tokens exceeds this (one bad token is enough
    to blow up a ratio); measured on the tiny model: fp32 vLLM ~1e-6, bf16 vLLM ~4e-3 (deep bf16 models more)."""
    mean_abs_diff: float | None = 0.1
    """Fail when the mean over loss tokens exceeds this (catches broad drift, e.g. a stale version)."""

    def __post_init__(self) -> None:
        for name in ("max_abs_diff", "mean_abs_diff"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise field_error(ConfigError, f"logp_check.{name}", v, "a finite value >= 0 or None",
                                  "use e.g. 1.0 (max) and 0.1 (mean); 0.0 demands bit-exact agreement")


@dataclass(frozen=True, kw_only=True)
class LogpAgreement:
    """Summary of one comparison."""

    mean_abs_diff: float
    max_abs_diff: float
    num_tokens: int

    def metrics(self, prefix: str = "logp_absdiff") -> dict[str, float]:
        """Float metrics for the step log / deck."""
        return {f"{prefix}_mean": self.mean_abs_diff, f"{prefix}_max": self.max_abs_diff,
                f"{prefix}_tokens": float(self.num_tokens)}


def logp_agreement(engine_logp: Tensor, replay_logp: Tensor, mask: Tensor) -> LogpAgreement:
    """Mean / max absolute difference over ``mask`` (all ``[B, R]``); non-finite values count as inf."""
    if engine_logp.shape != replay_logp.shape or mask.shape != engine_logp.shape:
        raise field_error(InvariantError, "logp shapes", (tuple(engine_logp.shape), tuple(replay_logp.shape),
                                                          tuple(mask.shape)), "three equal [B, R] shapes",
                          "compare log-probs of the same padded layout")
    if mask.dtype != torch.bool:
        raise field_error(InvariantError, "mask.dtype", mask.dtype, "torch.bool", "pass the loss mask as bool")
    n = int(mask.sum())
    if n == 0:
        return LogpAgreement(mean_abs_diff=0.0, max_abs_diff=0.0, num_tokens=0)
    diff = (engine_logp.double() - replay_logp.double()).abs()[mask]
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
    return LogpAgreement(mean_abs_diff=float(diff.mean()), max_abs_diff=float(diff.max()), num_tokens=n)


def check_logp_agreement(agreement: LogpAgreement, cfg: LogpCheckConfig, *, where: str = "rollout") -> None:
    """Log the agreement and raise ``NumericsError`` when a bound is exceeded."""
    logger.info("%s logp agreement: mean %.3g max %.3g over %d tokens", where, agreement.mean_abs_diff,
                agreement.max_abs_diff, agreement.num_tokens)
    fix = ("the engine and the trainer ran different weights, dtype, chat template or temperature; "
           "check the served policy version and the engine dtype (fp32 agrees to ~1e-5)")
    if cfg.max_abs_diff is not None and not agreement.max_abs_diff <= cfg.max_abs_diff:
        raise field_error(NumericsError, f"{where}.logp_absdiff_max", agreement.max_abs_diff,
                          f"<= {cfg.max_abs_diff}", fix)
    if cfg.mean_abs_diff is not None and not agreement.mean_abs_diff <= cfg.mean_abs_diff:
        raise field_error(NumericsError, f"{where}.logp_absdiff_mean", agreement.mean_abs_diff,
                          f"<= {cfg.mean_abs_diff}", fix)


def replay_agreement(policy, batch: SampleBatch, *, micro_batch_size: int = 16) -> LogpAgreement:
    """Replay ``batch`` with the trainer's forward (``unirl_core.models.lm``) and compare to the engine's
    recorded log-probs, micro-batch by micro-batch (no grad)."""
    from unirl_core.models.lm import build_layout, logprob_chunk_tokens, replay_log_probs

    segs: list[TokenSegment] = []
    temps: list[float] = []
    for i, part in enumerate(batch.generated):
        if not isinstance(part.segment, TokenSegment):
            raise field_error(InvariantError, f"batch[{i}].segment", type(part.segment).__name__, "a TokenSegment",
                              "run an AR rollout engine first")
        segs.append(part.segment)
        temps.append((part.sampling or ARSamplingParams()).temperature)
    device = next(policy.module.parameters()).device
    diffs: list[Tensor] = []
    compute = policy.compute() if hasattr(policy, "compute") else contextlib.nullcontext()
    with torch.no_grad(), compute:
        for k in range(0, len(segs), micro_batch_size):
            layout = build_layout(segs[k:k + micro_batch_size], temps[k:k + micro_batch_size],
                                  pad_id=int(policy.pad_token_id), device=device)
            replay, _ = replay_log_probs(policy.module, layout, chunk_tokens=logprob_chunk_tokens(policy))
            diffs.append(_masked_absdiff(layout.stored_log_probs, replay, layout.loss_mask))
    diff = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if diff.numel() == 0:
        return LogpAgreement(mean_abs_diff=0.0, max_abs_diff=0.0, num_tokens=0)
    return LogpAgreement(mean_abs_diff=float(diff.mean()), max_abs_diff=float(diff.max()), num_tokens=diff.numel())


def _masked_absdiff(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    d = (a.double() - b.double()).abs()[mask].cpu()
    return torch.where(torch.isfinite(d), d, torch.full_like(d, math.inf))


def summarize(agreements: Sequence[LogpAgreement]) -> LogpAgreement:
    """Token-weighted mean and overall max of several comparisons (e.g. rollout shards)."""
    n = sum(a.num_tokens for a in agreements)
    if n == 0:
        return LogpAgreement(mean_abs_diff=0.0, max_abs_diff=0.0, num_tokens=0)
    mean = sum(a.mean_abs_diff * a.num_tokens for a in agreements) / n
    return LogpAgreement(mean_abs_diff=mean, max_abs_diff=max(a.max_abs_diff for a in agreements), num_tokens=n)
