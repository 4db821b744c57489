"""DAPO dynamic sampling (arXiv 2503.14476): drop groups whose rewards are all equal, refill the batch.

A group whose valid rewards are all equal has zero advantage everywhere: it adds no policy gradient but
still dilutes token-mean losses. ``fill_groups`` keeps the groups with signal from the step's rewarded batch
and asks for more rounds of rollouts (whole batches of new prompts, as verl's ``filter_groups`` does) until
``groups`` groups with signal are collected or ``max_rounds`` rounds (the first included) have run. If rounds
run out, the batch is topped up with dropped groups in generation order, so it always has the configured size
(those groups get advantage 0, as in plain GRPO) and the train geometry never changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from unirl_core.advantage.group import zero_std_groups
from unirl_core.errors import ConfigError, InvariantError, field_error
from unirl_core.types import SampleBatch

MAX_ROUNDS = 256
"""Upper bound of ``max_num_gen_batches``: refill prompts are indexed by (step, round) in the prompt stream."""


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """Dynamic sampling (verl ``algorithm.filter_groups``; set the section to enable it)."""

    max_num_gen_batches: int = 4
    """Generation rounds per step, the first included (verl's name); each extra round samples
    ``data.prompts_per_step`` new prompts. When they run out the batch is topped up with dropped groups."""

    def __post_init__(self) -> None:
        if not (isinstance(self.max_num_gen_batches, int) and 1 <= self.max_num_gen_batches <= MAX_ROUNDS):
            raise field_error(ConfigError, "filter_groups.max_num_gen_batches", self.max_num_gen_batches,
                              f"an integer in [1, {MAX_ROUNDS}]", "use e.g. 4 (1 filters without refilling)")


def split_groups(batch: SampleBatch, *, atol: float) -> tuple[list[list[int]], list[list[int]]]:
    """Indices of each group (first-seen order), split into groups with reward spread and flat ones.

    Only valid rewards count; a group with fewer than two valid rewards is flat."""
    groups = list(batch.groups().values())
    rewards, index = [], []
    for g, members in enumerate(groups):
        for i in members:
            part = batch.samples[i].generated
            if part.valid and part.reward is not None and math.isfinite(part.reward):
                rewards.append(part.reward)
                index.append(g)
    if not rewards:
        return [], groups
    flat = zero_std_groups(torch.tensor(rewards, dtype=torch.float64), torch.tensor(index, dtype=torch.int64),
                           atol=atol).tolist()
    flat += [True] * (len(groups) - len(flat))  # trailing groups without a valid reward
    counts = torch.bincount(torch.tensor(index), minlength=len(groups)).tolist()
    keep = [m for g, m in enumerate(groups) if counts[g] >= 2 and not flat[g]]
    drop = [m for g, m in enumerate(groups) if counts[g] < 2 or flat[g]]
    return keep, drop


def fill_groups(first: SampleBatch, more: Callable[[int], SampleBatch], *, groups: int, max_rounds: int,
                atol: float) -> tuple[SampleBatch, dict[str, float]]:
    """A batch of exactly ``groups`` groups, preferring groups with reward spread.

    ``first`` is the step's rewarded batch; ``more(r)`` returns the rewarded batch of extra round ``r``
    (1, 2, ...), called only while groups are missing and ``r < max_rounds``. Returns the batch (whole groups,
    contiguous, in generation order) and ``filter_groups/*`` metrics.
    """
    kept: list[SampleBatch] = []
    dropped: list[SampleBatch] = []
    n_first = len(first.groups())
    if n_first != groups:
        raise field_error(InvariantError, "filter_groups first batch", n_first,
                          f"{groups} groups (data.prompts_per_step)", "pass the step's whole rewarded batch")
    rounds, first_kept = 0, 0
    batch: SampleBatch | None = first
    while batch is not None:
        keep, drop = split_groups(batch, atol=atol)
        kept += [batch.select(m) for m in keep]
        dropped += [batch.select(m) for m in drop]
        if rounds == 0:
            first_kept = len(keep)
        rounds += 1
        batch = more(rounds) if len(kept) < groups and rounds < max_rounds else None
    padded = max(groups - len(kept), 0)
    out = SampleBatch.concat(kept[:groups] + dropped[:padded], metadata=dict(first.metadata))
    metrics = {"filter_groups/rounds": float(rounds), "filter_groups/dropped_groups": float(len(dropped)),
               "filter_groups/kept_first_round": float(first_kept),
               "filter_groups/refilled_groups": float(min(len(kept), groups) - first_kept),
               "filter_groups/padded_groups": float(padded)}
    return out, metrics
