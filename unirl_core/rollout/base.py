"""The engine contract every rollout backend implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from unirl_core.types import NoiseRecipe, SampleBatch


@runtime_checkable
class RolloutEngine(Protocol):
    """Fills the generated Part of every Sample of a request batch.

    ``generate`` returns a new batch in the same order with ``segment``, ``media``/``text``,
    ``conditions`` and ``policy_version`` filled; it never touches rewards or advantages.
    Diffusion engines take the initial noise from ``noise`` and use the pinned sigma schedule
    verbatim, echoing what they used into ``DiffusionSegment.sigmas``.
    """

    policy_version: int

    def generate(self, batch: SampleBatch, *, noise: NoiseRecipe | None = None) -> SampleBatch: ...
