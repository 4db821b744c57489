"""GRPO for language models, with DAPO / Dr.GRPO aggregations, sequence ratios, KL and TIS.

Shapes: B = sequences in the micro-batch, R = longest response; every per-token tensor is
``[B, R]`` and ``mask`` marks the tokens that enter the loss (real, unpadded, ``response_mask``).

Per token: ``rho = exp(logp - logp_old)`` (token level) or ``exp(mean_t(logp - logp_old))`` of
its sequence (sequence level, GSPO); ``pg = -min(rho * A, clip(rho, 1 - eps, 1 + eps_high) * A)``;
optionally times the truncated-IS weight ``min(exp(logp_old - logp_rollout), C)`` (detached), and
plus ``beta * KL_k(logp, logp_ref)``. Aggregation over the micro-batch:

- ``grpo``:    mean over sequences of each sequence's token mean;
- ``dapo``:    sum over all tokens / number of tokens (token mean);
- ``dr_grpo``: sum over all tokens / (B * ``max_response_tokens``) (a constant normaliser).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from unirl_core.algorithms.base import LossOutput, Policy
from unirl_core.algorithms.kl import KL_ESTIMATORS, KLEstimator, kl_penalty
from unirl_core.algorithms.off_policy import ISLevel, behaviour_weights, check_is_config, fresh_rows, staleness_metrics
from unirl_core.algorithms.registry import register_algorithm
from unirl_core.errors import ConfigError, InvariantError, NumericsError, field_error
from unirl_core.models.lm import ReplayLayout, build_layout, logprob_chunk_tokens, replay_log_probs
from unirl_core.types import ARSamplingParams, SampleBatch, TokenSegment

LossAgg = Literal["grpo", "dapo", "dr_grpo"]
RatioLevel = Literal["token", "sequence"]


@dataclass(frozen=True, kw_only=True)
class LMLossConfig:
    """Knobs every token-level LM loss shares (GRPO, CISPO): aggregation, KL, TIS, the replay check, and
    DAPO's overlong handling. Each algorithm's config adds its own ratio/clip knobs and a ``name``."""

    name: str = field(default="", init=False)
    """Registry name (``unirl_core.algorithms.registry``), fixed by each subclass."""
    loss_agg: LossAgg = "grpo"
    """``grpo`` (per-sequence mean), ``dapo`` (token mean), ``dr_grpo`` (constant normaliser)."""
    beta: float = 0.0
    """KL coefficient against the reference policy; 0 skips the reference forward."""
    kl_estimator: KLEstimator = "k3"
    """``k1``, ``k2`` or ``k3`` (see ``unirl_core.algorithms.kl``)."""
    tis_cap: float | None = None
    """Truncated importance sampling cap C: the loss is weighted by ``min(pi_old / pi_behav, C)`` (detached), for
    rollouts from another engine or an older policy version; needs a replayed pi_old (``train.old_logp_source:
    replay``). With a lagged rollout this is AReaL's decoupled objective (``unirl_core/algorithms/off_policy.py``)."""
    mis_bounds: tuple[float, float] | None = None
    """Masked importance sampling (IcePop): tokens (sequences, with ``is_level: sequence``) whose ``pi_old / pi_behav``
    lies outside ``[low, high]`` get weight 0, the others weight ``pi_old / pi_behav``; combines with ``tis_cap``.
    Needs a replayed pi_old. None: off."""
    is_level: ISLevel = "token"
    """Level of the behaviour weight of ``tis_cap`` / ``mis_bounds``: ``token`` (per token) or ``sequence`` (the
    product of the sequence's token ratios, shared by its tokens)."""
    max_response_tokens: int | None = None
    """Dr.GRPO's constant normaliser (usually the sampling ``max_new_tokens``); required for ``dr_grpo``."""
    max_logp_absdiff: float | None = 1.0
    """Fail closed (NumericsError) when max |logp_rollout - logp_old_replay| over loss tokens exceeds this;
    trainside sampling gives exactly 0, a bf16 dedicated engine typically < 0.3; None disables."""
    mask_truncated_completions: bool = False
    """Exclude completions that stopped at the token limit (``finish_reason='length'``, no EOS) from the loss
    (TRL's ``mask_truncated_completions``, DAPO's overlong filtering). They still count in the advantages."""
    overlong_buffer_len: int | None = None
    """DAPO's soft overlong punishment: a linear reward penalty over the last ``overlong_buffer_len`` tokens
    before ``lm.sampling.max_new_tokens`` (verl ``reward_model.overlong_buffer.len``); applied to the total
    reward in the reward phase, before filtering and advantages. None: off."""
    overlong_penalty_factor: float = 1.0
    """Penalty at the token limit (verl ``overlong_buffer.penalty_factor``); 0 at the buffer's start."""

    def __post_init__(self) -> None:
        n = self.name
        if self.loss_agg not in ("grpo", "dapo", "dr_grpo"):
            raise field_error(ConfigError, f"{n}.loss_agg", self.loss_agg, "'grpo', 'dapo' or 'dr_grpo'", "pick one")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise field_error(ConfigError, f"{n}.kl_estimator", self.kl_estimator, f"one of {KL_ESTIMATORS}",
                              "use 'k3'")
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise field_error(ConfigError, f"{n}.beta", self.beta, "a finite value >= 0", "use 0.0 or e.g. 0.04")
        check_is_config(n, self.is_level, self.tis_cap, self.mis_bounds)
        if self.loss_agg == "dr_grpo" and not (isinstance(self.max_response_tokens, int)
                                               and self.max_response_tokens >= 1):
            raise field_error(ConfigError, f"{n}.max_response_tokens", self.max_response_tokens,
                              "an integer >= 1 with loss_agg='dr_grpo'", "set it to the sampling max_new_tokens")
        if self.max_logp_absdiff is not None and not (self.max_logp_absdiff >= 0):
            raise field_error(ConfigError, f"{n}.max_logp_absdiff", self.max_logp_absdiff, "a value >= 0 or None",
                              "use e.g. 1.0, or 0.0 to demand bit-exact replay")
        if self.overlong_buffer_len is not None and not (isinstance(self.overlong_buffer_len, int)
                                                         and self.overlong_buffer_len >= 1):
            raise field_error(ConfigError, f"{n}.overlong_buffer_len", self.overlong_buffer_len,
                              "None or an integer >= 1", "DAPO uses 4096 of 20480 tokens; e.g. a fifth of "
                              "max_new_tokens")
        if not (self.overlong_penalty_factor >= 0 and math.isfinite(self.overlong_penalty_factor)):
            raise field_error(ConfigError, f"{n}.overlong_penalty_factor", self.overlong_penalty_factor,
                              "a finite value >= 0", "use 1.0 (DAPO)")


@dataclass(frozen=True, kw_only=True)
class GRPOConfig(LMLossConfig):
    """Loss of the LM GRPO family (GRPO, DAPO, Dr.GRPO, GSPO)."""

    name: Literal["grpo"] = field(default="grpo", init=False)
    epsilon: float = 0.2
    """Lower clip range: the ratio is clipped below at ``1 - epsilon``."""
    epsilon_high: float | None = None
    """Upper clip range (DAPO's clip-higher, e.g. 0.28); None uses ``epsilon``."""
    ratio_level: RatioLevel = "token"
    """``token`` (GRPO) or ``sequence`` (GSPO: length-normalised sequence log-ratio, shared by its tokens)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratio_level not in ("token", "sequence"):
            raise field_error(ConfigError, "grpo.ratio_level", self.ratio_level, "'token' or 'sequence'", "pick one")
        for name in ("epsilon", "epsilon_high"):
            v = getattr(self, name)
            if v is not None and not (0 < v < 10 and math.isfinite(v)):
                raise field_error(ConfigError, f"grpo.{name}", v, "a value in (0, 10)", "use e.g. 0.2 (0.28 high)")

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# ----------------------------------------------------------------------------- pure math


def log_ratios(logp: Tensor, old_logp: Tensor, mask: Tensor, level: RatioLevel) -> Tensor:
    """``[B, R]`` log importance ratios; at sequence level every token carries its sequence's mean."""
    d = (logp - old_logp) * mask
    if level == "token":
        return d
    per_seq = d.sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq[:, None].expand_as(d) * mask


def aggregate(per_token: Tensor, mask: Tensor, mode: LossAgg, max_response_tokens: int | None) -> Tensor:
    """Reduce a masked ``[B, R]`` loss to a scalar per ``mode`` (see the module docstring)."""
    m = mask.to(per_token.dtype)
    total = per_token * m
    if mode == "grpo":
        return (total.sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if mode == "dapo":
        return total.sum() / m.sum().clamp(min=1)
    return total.sum() / (per_token.shape[0] * max_response_tokens)


def grpo_token_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: GRPOConfig, *,
                    ref_logp: Tensor | None = None, rollout_logp: Tensor | None = None) -> tuple[Tensor, dict]:
    """The GRPO-family loss of one micro-batch. Pure: no model, no state.

    ``logp`` [B, R] current log-probs (with grad), ``old_logp`` [B, R] pi_old, ``advantages`` [B],
    ``mask`` [B, R] bool, ``ref_logp`` [B, R] (needed when beta > 0), ``rollout_logp`` [B, R] the
    behaviour policy's log-probs (TIS / MIS when ``cfg.tis_cap`` / ``cfg.mis_bounds`` is set). Returns
    ``(loss, stats)`` where stats holds detached tensors: ratio [B, R], clipped [B, R] bool, kl [B, R] or None,
    tis [B, R] (the behaviour weight), is_masked / is_truncated [B, R] bool.
    """
    mf = mask.to(logp.dtype)
    lr = log_ratios(logp, old_logp.detach(), mf, cfg.ratio_level)
    ratio = torch.exp(lr)
    adv = advantages.to(logp.dtype)[:, None]
    unclipped = ratio * adv
    clipped_ratio = ratio.clamp(1.0 - cfg.epsilon, 1.0 + cfg.eps_high)
    per_token = -torch.minimum(unclipped, clipped_ratio * adv)
    is_clipped = ((ratio < 1.0 - cfg.epsilon) & (adv < 0)) | ((ratio > 1.0 + cfg.eps_high) & (adv > 0))
    loss, stats = finish_token_loss(per_token, logp, old_logp, mask, cfg, ref_logp=ref_logp,
                                    rollout_logp=rollout_logp)
    return loss, {"ratio": ratio.detach(), "clipped": is_clipped & mask, **stats}


def finish_token_loss(per_token: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor, cfg: LMLossConfig, *,
                      ref_logp: Tensor | None, rollout_logp: Tensor | None) -> tuple[Tensor, dict]:
    """The tail every GRPO-family token loss shares: the behaviour-policy weights (TIS / MIS), the KL term
    (``cfg.beta``) and the aggregation (``cfg.loss_agg``). Returns ``(loss, stats)`` with the detached ``tis``,
    ``kl`` (or None), ``is_masked`` and ``is_truncated``."""
    per_token, tis, is_masked, is_truncated = apply_behaviour_weights(per_token, old_logp, rollout_logp, mask, cfg)
    kl = None
    if cfg.beta > 0:
        if ref_logp is None:
            raise field_error(InvariantError, "ref_logp", None, "reference log-probs when beta > 0",
                              "replay the reference policy (policy.reference()) or set beta=0")
        kl = kl_penalty(logp, ref_logp.detach(), cfg.kl_estimator)
        per_token = per_token + cfg.beta * kl
    loss = aggregate(per_token, mask, cfg.loss_agg, cfg.max_response_tokens)
    return loss, {"tis": tis.detach(), "kl": None if kl is None else kl.detach(), "is_masked": is_masked,
                  "is_truncated": is_truncated}


def apply_behaviour_weights(per_token: Tensor, old_logp: Tensor, rollout_logp: Tensor | None, mask: Tensor,
                            cfg: LMLossConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``per_token`` times the behaviour weight of ``cfg`` (TIS / MIS of pi_old over pi_behav = the rollout's
    log-probs); returns ``(per_token, weight, masked, truncated)``; weight 1 when no correction is configured."""
    m = mask.bool()
    if rollout_logp is None or (cfg.tis_cap is None and cfg.mis_bounds is None):
        none = torch.zeros_like(m)
        return per_token, torch.ones_like(per_token), none, none
    w, masked, truncated = behaviour_weights(old_logp, rollout_logp, m, level=cfg.is_level, tis_cap=cfg.tis_cap,
                                             mis_bounds=cfg.mis_bounds)
    return per_token * w, w, masked, truncated


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


# ----------------------------------------------------------------------------- Algorithm


class GRPO:
    """``Algorithm`` over AR Parts: replays token log-probs with ``replay_log_probs`` and applies the loss."""

    def __init__(self, config: LMLossConfig | None = None) -> None:
        self.config = config or GRPOConfig()

    def layout(self, policy: Policy, micro_batch: SampleBatch) -> ReplayLayout:
        """The padded replay layout of a micro-batch (the same one the trainside engine rescored)."""
        segs, temps = [], []
        for i, part in enumerate(micro_batch.generated):
            if not isinstance(part.segment, TokenSegment):
                raise field_error(InvariantError, f"micro_batch[{i}].segment", type(part.segment).__name__,
                                  "a TokenSegment", "run an AR rollout engine before training")
            segs.append(part.segment)
            temps.append((part.sampling or ARSamplingParams()).temperature)
        device = next(policy.module.parameters()).device
        return build_layout(segs, temps, pad_id=_pad_id(policy), device=device)

    def old_log_probs(self, policy: Policy, micro_batch: SampleBatch) -> Tensor:
        """pi_old ``[B, R]`` replayed over exactly this micro-batch; checks it against the rollout log-probs."""
        layout = self.layout(policy, micro_batch)
        with torch.no_grad():
            logp, _ = replay_log_probs(policy.module, layout, chunk_tokens=logprob_chunk_tokens(policy))
        self._check_absdiff(layout, logp, micro_batch)
        return logp

    def loss(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
             first_update: bool = False) -> LossOutput:
        cfg = self.config
        layout = self.layout(policy, micro_batch)
        adv = _advantages(micro_batch).to(layout.input_ids.device)
        logp, entropy = replay_log_probs(policy.module, layout, with_entropy=True,
                                         chunk_tokens=logprob_chunk_tokens(policy))
        if old_log_probs is not None:
            if old_log_probs.shape != logp.shape:
                raise field_error(InvariantError, "old_log_probs.shape", tuple(old_log_probs.shape),
                                  f"{tuple(logp.shape)} (this micro-batch's layout)",
                                  "compute pi_old with old_log_probs() over the same micro-batch")
            old = old_log_probs.to(logp.device)
            self._check_absdiff(layout, old, micro_batch)
        else:
            old = layout.stored_log_probs
            if first_update:  # the current forward is pi_old as replayed
                self._check_absdiff(layout, logp.detach(), micro_batch)
        ref = None
        if cfg.beta > 0:
            with torch.no_grad(), policy.reference():
                ref, _ = replay_log_probs(policy.module, layout, chunk_tokens=logprob_chunk_tokens(policy))
        truncated = truncated_completions(micro_batch).to(layout.loss_mask.device)
        mask = layout.loss_mask & ~truncated[:, None] if cfg.mask_truncated_completions else layout.loss_mask
        loss, stats = self.token_loss(logp, old, adv, mask, ref_logp=ref, rollout_logp=layout.stored_log_probs)
        metrics = self._metrics(layout, logp, old, entropy, stats)
        metrics["truncated_frac"] = float(truncated.float().mean())
        metrics.update(staleness_metrics(micro_batch))
        return LossOutput(loss=loss, metrics=metrics)

    def micro_batch_units(self, micro_batch: SampleBatch) -> float:
        """What the backend weighs this micro-batch's loss by (its share of the batch's units): samples for
        ``grpo`` / ``dr_grpo`` (per-sample means), loss tokens for ``dapo``'s token mean - so the batch loss is
        the token mean over the whole batch whatever the micro-batch packing (fixed counts or token budgets)."""
        if self.config.loss_agg != "dapo":
            return float(len(micro_batch))
        drop = truncated_completions(micro_batch).tolist() if self.config.mask_truncated_completions else None
        return float(sum(int(p.segment.response_mask.sum()) for i, p in enumerate(micro_batch.generated)
                         if not (drop and drop[i])))

    def token_loss(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                   ref_logp: Tensor | None, rollout_logp: Tensor) -> tuple[Tensor, dict]:
        """The pure loss this algorithm applies (``grpo_token_loss``); variants override only this."""
        return grpo_token_loss(logp, old_logp, advantages, mask, self.config, ref_logp=ref_logp,
                               rollout_logp=rollout_logp)

    def _check_absdiff(self, layout: ReplayLayout, old: Tensor, micro_batch: SampleBatch) -> None:
        """Fail closed on rows sampled by the trainer's current weights; a stale row's gap is policy drift
        (the off-policy correction's business, logged as ``logp_absdiff``), not a numerics error."""
        limit = self.config.max_logp_absdiff
        if limit is None:
            return
        rows = fresh_rows(micro_batch).to(layout.loss_mask.device)
        diff = ((old - layout.stored_log_probs).abs() * (layout.loss_mask & rows[:, None])).max()
        if float(diff) > limit:
            raise field_error(NumericsError, "logp_absdiff_max", float(diff), f"<= {limit}",
                              "rollout and replay disagree: check that the engine ran the same weights, "
                              "chat template, temperature and dtype as the trainer")

    def _metrics(self, layout: ReplayLayout, logp: Tensor, old: Tensor, entropy: Tensor, stats: dict) -> dict:
        mask = layout.loss_mask
        mf = mask.float()
        ratio = stats["ratio"]
        absdiff = (layout.stored_log_probs - (old if old is not layout.stored_log_probs else logp.detach())).abs()
        out = {
            "ratio_mean": _masked_mean(ratio, mf),
            "ratio_min": float(ratio[mask].min()) if mask.any() else 1.0,
            "ratio_max": float(ratio[mask].max()) if mask.any() else 1.0,
            "clip_frac": _masked_mean(stats["clipped"].float(), mf),
            "entropy": _masked_mean(entropy, mf),
            "response_len_mean": float(layout.valid.sum(-1).float().mean()),
            "logp_absdiff_mean": _masked_mean(absdiff, mf),
            "logp_absdiff_max": float((absdiff * mf).max()),
        }
        if stats["kl"] is not None:
            out["kl"] = _masked_mean(stats["kl"], mf)
        if self.config.tis_cap is not None:
            out["tis_mean"] = _masked_mean(stats["tis"], mf)
        if self.config.tis_cap is not None or self.config.mis_bounds is not None:
            out["is_weight_mean"] = _masked_mean(stats["tis"], mf)
            out["is_masked_frac"] = _masked_mean(stats["is_masked"].float(), mf)
            out["is_truncated_frac"] = _masked_mean(stats["is_truncated"].float(), mf)
        return out


def truncated_completions(batch: SampleBatch) -> Tensor:
    """``[B]`` bool: the completion stopped at the token limit without EOS (``finish_reason == 'length'``)."""
    return torch.tensor([getattr(p.segment, "finish_reason", None) == "length" for p in batch.generated],
                        dtype=torch.bool)


def _pad_id(policy: Policy) -> int:
    pad = getattr(policy, "pad_token_id", None)
    if pad is None:
        raise field_error(InvariantError, "policy.pad_token_id", None, "an int on the LM policy",
                          "train with unirl_core.models.lm.LMBundle (it pads exactly like the engine)")
    return int(pad)


def _advantages(batch: SampleBatch) -> Tensor:
    adv = [p.advantage for p in batch.generated]
    missing = [s.sample_id for s, a in zip(batch.samples, adv) if a is None]
    if missing:
        raise field_error(InvariantError, "part.advantage", missing[:5], "an advantage on every trained Part",
                          "run the advantage phase before training")
    return torch.tensor(adv, dtype=torch.float32)


register_algorithm("grpo", family="lm", config=GRPOConfig, build=GRPO)
