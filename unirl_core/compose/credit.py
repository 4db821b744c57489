"""Credit for both Parts: the image reward propagates to its enhancement, and each Part is normalised
within its own groups.

- ``propagate_rewards``: the diffusion Part's reward (scored against the original prompt) is the image's; the AR
  Part of enhancement ``p/i`` gets the mean over its ``G_i`` valid images (each component too), written on every
  copy. An enhancement with no valid image is invalid.
- ``enhancer_batch`` / ``image_batch``: the stack projections, one Sample per enhancement (``p/i``, group ``p``)
  and one per image (``p/i/j``, group ``p/i`` or ``p``, see ``GroupingConfig.image_groups``), each holding one
  generated Part (a copy carrying the stack's lineage ids), in the engines' orders (the exact-ratio contract).
- ``assign_compose_advantages``: the project's ``assign_advantages`` on each projection.
"""

from __future__ import annotations

import math

from unirl_core.advantage.batch import assign_advantages
from unirl_core.advantage.config import AdvantageConfig
from unirl_core.compose.config import GroupingConfig
from unirl_core.compose.engine import check_composed, enhancement_id
from unirl_core.types import Part, Sample, SampleBatch


def _valid(part: Part) -> bool:
    return bool(part.valid) and part.reward is not None and math.isfinite(part.reward)


def propagate_rewards(batch: SampleBatch) -> dict[str, float]:
    """Write each enhancement's mean image reward on its AR Parts (in place); returns metrics."""
    check_composed(batch)
    by_enh: dict[str, list[Sample]] = {}
    for s in batch.samples:
        by_enh.setdefault(enhancement_id(s), []).append(s)
    rewards = []
    for siblings in by_enh.values():
        images = [s.parts[1] for s in siblings if _valid(s.parts[1])]
        reward = sum(p.reward for p in images) / len(images) if images else None
        comps = {k: sum(p.rewards[k] for p in images if k in p.rewards) / len(images)
                 for k in (images[0].rewards if images else {})}
        for s in siblings:
            ar = s.parts[0]
            ar.reward, ar.rewards, ar.valid = reward, dict(comps), bool(images)
        if reward is not None:
            rewards.append(reward)
    spread = [max(r) - min(r) for r in _per_prompt(batch, by_enh).values() if len(r) > 1]
    return {"enhancer/reward/mean": sum(rewards) / len(rewards) if rewards else math.nan,
            "enhancer/reward/group_range_mean": sum(spread) / len(spread) if spread else math.nan}


def _per_prompt(batch: SampleBatch, by_enh: dict[str, list[Sample]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for siblings in by_enh.values():
        ar = siblings[0].parts[0]
        if ar.reward is not None:
            out.setdefault(siblings[0].group_id, []).append(ar.reward)
    return out


def enhancer_batch(batch: SampleBatch) -> SampleBatch:
    """The enhancer stack's rows: the first AR Part copy of each enhancement ``p/i``, as a one-Part Sample."""
    check_composed(batch)
    samples, seen = [], set()
    for s in batch.samples:
        eid = enhancement_id(s)
        if eid in seen:
            continue
        seen.add(eid)
        samples.append(Sample(sample_id=eid, group_id=s.group_id, parts=[s.parts[0].copy(sample_id=eid)]))
    return SampleBatch(samples=samples, metadata=dict(batch.metadata))


def image_batch(batch: SampleBatch, grouping: GroupingConfig) -> SampleBatch:
    """The image stack's rows: each diffusion Part as a one-Part Sample, grouped per ``grouping.image_groups``."""
    check_composed(batch)
    samples = []
    for s in batch.samples:
        group = enhancement_id(s) if grouping.image_groups == "enhancement" else s.group_id
        part = s.parts[1].copy(group_id=group, parent=None)
        samples.append(Sample(sample_id=s.sample_id, group_id=group, parts=[part]))
    return SampleBatch(samples=samples, metadata=dict(batch.metadata))


def assign_compose_advantages(batch: SampleBatch, grouping: GroupingConfig,
                              cfg: AdvantageConfig) -> dict[str, float]:
    """Advantages of both Parts, each normalised within its own groups, written back on the composed batch (every
    copy of an enhancement's AR Part gets its advantage). The train phase projects the batch again."""
    metrics: dict[str, float] = {}
    enh = enhancer_batch(batch)
    _, stats = assign_advantages(enh, cfg)
    advantage = {s.sample_id: s.parts[0].advantage for s in enh.samples}
    for s in batch.samples:
        s.parts[0].advantage = advantage[enhancement_id(s)]
    metrics.update(stats.as_metrics("enhancer/advantage/"))
    img = image_batch(batch, grouping)
    _, stats = assign_advantages(img, cfg)
    for s, row in zip(batch.samples, img.samples):
        s.parts[1].advantage = row.parts[0].advantage
    metrics.update(stats.as_metrics("image/advantage/"))
    return metrics
