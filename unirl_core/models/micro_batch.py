"""Which samples share an LM micro-batch: the one plan the engine's rescoring and the trainer's replay both use.

The bits of a replayed log-prob can depend on the padded shape and the rows of its micro-batch (matmul and
attention kernels pick their reductions by shape), so the first update's ratio is exactly 1 only when the
trainer replays over the micro-batches the engine recorded with. Both sides therefore call
``plan_micro_batches`` on the same samples in the same order and get the same index lists.

Two plans:

- fixed count (``max_tokens=None``): consecutive slices of ``size`` samples in batch order;
- token budget (``max_tokens=N``, verl's ``use_dynamic_bsz`` + ``ppo_max_token_len_per_gpu``): samples sorted
  by total length (prompt + response, longest first, ties in batch order), then filled greedily while the
  micro-batch's padded size ``rows x (longest prompt + longest response)`` (what ``build_layout`` allocates)
  stays within ``N``. A sample longer than ``N`` on its own gets a micro-batch of one row. Deterministic: it
  depends only on the lengths.

Under FSDP every rank packs its own shard and must run as many forwards as the others: ``split_to_count``
halves a rank's fullest micro-batches until it has the count of the rank with the most (the trainer then
replays pi_old over its own micro-batches, ``old_logp_source='replay'``).
"""

from __future__ import annotations

from collections.abc import Sequence

from unirl_core.errors import ConfigError, InvariantError, field_error
from unirl_core.types import TokenSegment

Lengths = Sequence[tuple[int, int]]
"""``(prompt tokens, response tokens)`` per sample, in batch order."""


def token_lengths(segments: Sequence[object], *, field: str = "train.micro_batch_tokens") -> list[tuple[int, int]]:
    """``(prompt, response)`` token counts of each segment; ``field`` names the knob in the error for non-LM data."""
    out = []
    for i, s in enumerate(segments):
        if not isinstance(s, TokenSegment):
            raise field_error(ConfigError, field, f"segment {i} is {type(s).__name__}",
                              "TokenSegments (token budgets apply to LM batches)",
                              f"remove {field} for this family and use micro_batch_size")
        out.append((int(s.prompt_ids.numel()), s.num_response_tokens))
    return out


def padded_tokens(lengths: Lengths, indices: Sequence[int]) -> int:
    """Tokens of the padded replay layout of ``indices``: rows x (longest prompt + longest response)."""
    return len(indices) * (max(lengths[i][0] for i in indices) + max(lengths[i][1] for i in indices))


def plan_micro_batches(lengths: Lengths, *, size: int, max_tokens: int | None) -> list[list[int]]:
    """Index lists of the micro-batches, in the order they run (see the module docstring).

    ``size``: rows per micro-batch of the fixed-count plan (ignored with ``max_tokens``).
    """
    n = len(lengths)
    if max_tokens is None:
        if not (isinstance(size, int) and size >= 1):
            raise field_error(InvariantError, "size", size, "an integer >= 1", "pass the micro-batch size")
        return [list(range(k, min(k + size, n))) for k in range(0, n, size)]
    check_max_tokens(max_tokens, "max_tokens")
    order = sorted(range(n), key=lambda i: (-(lengths[i][0] + lengths[i][1]), i))
    plan: list[list[int]] = []
    cur: list[int] = []
    longest_p = longest_r = 0
    for i in order:
        p, r = max(longest_p, lengths[i][0]), max(longest_r, lengths[i][1])
        if cur and (len(cur) + 1) * (p + r) > max_tokens:
            plan.append(cur)
            cur, p, r = [], lengths[i][0], lengths[i][1]
        cur.append(i)
        longest_p, longest_r = p, r
    if cur:
        plan.append(cur)
    return plan


def split_to_count(plan: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """``plan`` with its micro-batch of most rows (the first on ties) halved until there are ``count``; a half
    pads to no more tokens than the whole, so the budget still holds."""
    out = [list(mb) for mb in plan]
    if not (len(out) <= count <= sum(len(mb) for mb in out)):
        raise field_error(InvariantError, "count", count, f"between {len(out)} micro-batches and "
                          f"{sum(len(mb) for mb in out)} samples", "every rank must hold the same number of samples")
    while len(out) < count:
        k = max(range(len(out)), key=lambda j: (len(out[j]), -j))
        half = (len(out[k]) + 1) // 2
        out[k:k + 1] = [out[k][:half], out[k][half:]]
    return out


def check_max_tokens(value: object, field: str) -> None:
    """Raise ``ConfigError`` unless ``value`` is None or an integer >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise field_error(ConfigError, field, value, "None or an integer >= 1 (padded tokens per micro-batch)",
                          "use e.g. 16384, at least the longest prompt + max_new_tokens")
