"""The projection a pool rollout emits, and the batch the trainer actor trains on.

In pool mode the full trajectories (diffusion latents ``[T+1, C, H, W]`` per sample, replay conditions such
as prompt embeddings) stay in the Ray object store between the engine and the trainer. What a phase returns
(and Flyte writes as its Arrow artifact) is a projection: prompts, media, text, token ids, per-step
log-probs, sigmas and masks, rewards and advantages. The reward and advantage phases work on it unchanged;
the train phase copies their results back onto the full batch (``for_training``).
"""

from __future__ import annotations

import torch

from unirl_core.errors import NumericsError, field_error
from unirl_core.types import DiffusionSegment, SampleBatch

PROJECTION_KEY = "unirl.pool.dropped"
"""Batch metadata key of a projection: the comma-separated fields that were left in the pool."""
DROPPED = "latents,conditions"


def project(batch: SampleBatch) -> SampleBatch:
    """A copy of ``batch`` without its big tensors: diffusion latents become ``[T+1, 0, 0, 0]`` (so the
    segment still says how many steps it has, in which dtype) and replay conditions are dropped."""
    samples = []
    for s in batch.samples:
        c = s.copy()
        for p in c.parts:
            p.conditions = {}
            if isinstance(p.segment, DiffusionSegment):
                seg = p.segment
                p.segment = DiffusionSegment(latents=seg.latents.new_empty((seg.latents.shape[0], 0, 0, 0)),
                                             log_probs=seg.log_probs, sigmas=seg.sigmas, sde_mask=seg.sde_mask)
        samples.append(c)
    return SampleBatch(samples=samples, metadata={**batch.metadata, PROJECTION_KEY: DROPPED})


def for_training(full: SampleBatch, scored: SampleBatch) -> SampleBatch:
    """The samples of ``scored`` (a projection after reward and advantage, possibly with groups dropped), in
    its order, as the full trajectories of ``full`` carrying ``scored``'s rewards, validity and advantages;
    the metadata is ``scored``'s (the advantage tracker state rides there).

    Fails closed when a sample is missing from ``full`` or its recorded log-probs differ from the
    projection's: the pool holds another batch than the one that was scored."""
    by_id = {s.sample_id: s for s in full.samples}
    samples = []
    for s in scored.samples:
        if s.sample_id not in by_id:
            raise field_error(NumericsError, "pool batch", s.sample_id, "every scored sample in the pool's "
                              "full batch of the step", "re-run the step's rollout (the pool lost or replaced "
                              "the batch)")
        c = by_id[s.sample_id].copy()
        src, dst = s.generated, c.generated
        if dst.segment is None or not torch.equal(src.segment.log_probs, dst.segment.log_probs):
            raise field_error(NumericsError, f"pool batch {s.sample_id}: log_probs", "differ",
                              "the log-probs of the projection that was scored", "re-run the step's rollout; "
                              "the pool's batch was sampled with other weights or another seed")
        dst.rewards, dst.reward = dict(src.rewards), src.reward
        dst.valid, dst.advantage = src.valid, src.advantage
        samples.append(c)
    meta = {k: v for k, v in scored.metadata.items() if k != PROJECTION_KEY}
    return SampleBatch(samples=samples, metadata=meta)
