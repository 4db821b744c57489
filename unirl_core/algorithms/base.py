"""The contract between a loss algorithm and the train backend.

A trainable bundle is a ``Policy``: it exposes the module the optimizer (and FSDP) owns and a way
to evaluate the reference policy for KL. An ``Algorithm`` is a set of pure-ish functions over a
micro-batch: it replays the stored trajectory under the current weights and returns a scalar loss
plus float metrics. The backend owns micro-batching, accumulation, pi_old freezing and the
optimizer; algorithms never call ``backward`` or ``step``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor, nn

from unirl_core.types import SampleBatch

OldLogpSource = Literal["rollout", "replay"]


@runtime_checkable
class Policy(Protocol):
    """A model bundle seen by training."""

    @property
    def module(self) -> nn.Module:
        """The trainable module (LoRA-wrapped or full); what the optimizer and FSDP wrap."""
        ...

    def reference(self) -> AbstractContextManager[None]:
        """Within this context the bundle's forward is the reference policy (LoRA off or a frozen copy)."""
        ...


@dataclass
class LossOutput:
    """What one micro-batch contributes: a scalar to backward and metrics to log."""

    loss: Tensor
    """Scalar loss for this micro-batch, already normalised as the algorithm's aggregation defines."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Float metrics (ratio_mean, ratio_min, ratio_max, clip_frac, kl, logp_absdiff_mean/max, ...)."""


@runtime_checkable
class Algorithm(Protocol):
    """A loss over replayed trajectories of one generated-Part kind."""

    def old_log_probs(self, policy: Policy, micro_batch: SampleBatch) -> Tensor:
        """Replay pi_old over exactly this micro-batch (called under no_grad, before the first update)."""
        ...

    def loss(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
             first_update: bool = False) -> LossOutput:
        """Loss of the micro-batch; ``old_log_probs`` None means use the log-probs stored at rollout.

        ``first_update``: the policy still holds the weights that sampled the batch, so the current
        log-probs ARE the replayed pi_old; the algorithm checks their gap to the stored log-probs against
        its tolerance (fail closed), also when ``old_log_probs`` is None.
        """
        ...


@runtime_checkable
class SteppedAlgorithm(Algorithm, Protocol):
    """An algorithm whose loss is a sum of terms the backend may back-propagate one at a time (e.g. Flow-GRPO's
    trained denoising steps), so only one term's graph is alive at once."""

    def num_loss_terms(self, micro_batch: SampleBatch) -> int:
        """How many terms ``loss_terms`` yields for this micro-batch (known before any forward)."""
        ...

    def loss_terms(self, policy: Policy, micro_batch: SampleBatch, *, old_log_probs: Tensor | None,
                   first_update: bool = False) -> Generator[Tensor, None, LossOutput]:
        """Yield scalar terms that add up to ``loss(...)``; return its ``LossOutput`` (detached loss, metrics)."""
        ...


def summed_loss(terms: Generator[Tensor, None, LossOutput]) -> LossOutput:
    """``loss(...)`` of a stepped algorithm: the sum of its ``loss_terms`` as one graph (every term's graph alive
    until backward) with the metrics the generator returns."""
    total = None
    while True:
        try:
            term = next(terms)
        except StopIteration as stop:
            return LossOutput(loss=total, metrics=stop.value.metrics)
        total = term if total is None else total + term
