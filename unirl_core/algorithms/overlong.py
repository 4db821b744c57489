"""DAPO's overlong reward shaping for LM rollouts (arXiv 2503.14476, "soft overlong punishment").

With ``L_max`` the sampling limit (``lm.sampling.max_new_tokens``), ``L_cache`` the buffer
(``overlong_buffer_len``) and ``|y|`` the response length in tokens:

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                = -1                                 if |y| > L_max

scaled by ``overlong_penalty_factor`` and added to the total reward before groups are filtered and
advantages normalised (verl adds it in its reward manager, ``reward_model.overlong_buffer``). The limit is
derived from the sampling config, never set twice. Truncation masking (the loss side) is
``LMLossConfig.mask_truncated_completions``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, field_error
from unirl_core.types import SampleBatch, TokenSegment

OVERLONG_COMPONENT = "overlong"
"""Name of the penalty in each Part's per-component ``rewards``."""


def overlong_penalty(lengths: Tensor, *, max_tokens: int, buffer_len: int, penalty_factor: float = 1.0) -> Tensor:
    """``[N]`` penalty (<= 0) of responses of ``lengths`` tokens, per the module docstring."""
    if not (1 <= buffer_len <= max_tokens):
        raise field_error(ConfigError, "overlong_buffer_len", buffer_len,
                          f"an integer in [1, max_new_tokens={max_tokens}]",
                          "make the buffer a part of the sampling budget, e.g. a fifth of it")
    expected = max_tokens - buffer_len
    over = (lengths.to(torch.float64) - expected) / buffer_len
    return -penalty_factor * over.clamp(min=0.0, max=1.0)


def apply_overlong_penalty(batch: SampleBatch, *, max_tokens: int, buffer_len: int,
                           penalty_factor: float) -> dict[str, float]:
    """Add the penalty to every valid generated Part's total ``reward`` (in place) and record it as the
    ``overlong`` component; returns metrics (mean penalty, fraction of penalised responses)."""
    parts = [p for p in batch.generated if p.valid and p.reward is not None and math.isfinite(p.reward)]
    if not parts:
        return {"reward/overlong_penalty_mean": 0.0, "reward/overlong_frac": 0.0}
    lengths = []
    for p in parts:
        if not isinstance(p.segment, TokenSegment):
            raise field_error(ConfigError, "lm.algorithm.overlong_buffer_len", buffer_len,
                              "unset for Parts without a TokenSegment", "the penalty counts response tokens")
        lengths.append(p.segment.num_response_tokens)
    penalty = overlong_penalty(torch.tensor(lengths), max_tokens=max_tokens, buffer_len=buffer_len,
                               penalty_factor=penalty_factor)
    for p, pen in zip(parts, penalty.tolist()):
        p.rewards[OVERLONG_COMPONENT] = pen
        p.reward = p.reward + pen
    return {"reward/overlong_penalty_mean": float(penalty.mean()),
            "reward/overlong_frac": float((penalty < 0).float().mean())}
