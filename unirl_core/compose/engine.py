"""The composed engine: an AR enhancer fills Part 0, a diffusion engine conditioned on it fills Part 1.

One prompt (id ``p``) fans out into ``G_e`` enhancements and each into ``G_i`` images: Sample ``p/i/j`` holds
``[ar Part (enhancement i), diffusion Part (image j, parent=0)]`` with ``group_id = p``. The ``G_i`` Samples of
one enhancement carry copies of the same AR Part; ``enhancement_id`` (``p/i``) is the lineage id that links them
(checked: equal ids hold equal tokens). The diffusion Part keeps the ORIGINAL prompt as its ``prompt`` (what the
scorers check) and is conditioned on its parent's text (``rollout.diffusion.conditioning_prompt``).

Order: the enhancer samples ``[p0/0, p0/1, ...]`` and the image engine ``[p0/0/0, p0/0/1, ...]``; the stack
projections (``unirl_core.compose.credit``) keep exactly these orders, so each trainer's micro-batches are the
engine's slices and the first update's ratio is exactly 1 on both Parts.
"""

from __future__ import annotations

from collections.abc import Sequence

from unirl_core.compose.config import GroupingConfig
from unirl_core.errors import InvariantError, field_error
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.rollout.diffusion import TrainsideDiffusionEngine
from unirl_core.types import (
    ARSamplingParams,
    DiffusionSamplingParams,
    NoiseRecipe,
    Part,
    PromptRecord,
    Sample,
    SampleBatch,
)


def enhancement_id(sample: Sample) -> str:
    """Lineage id of the enhancement a composed Sample renders: ``<prompt id>/<i>`` of id ``<prompt id>/<i>/<j>``."""
    return sample.sample_id.rsplit("/", 1)[0]


def check_composed(batch: SampleBatch) -> None:
    """Every Sample is ``[ar, diffusion(parent=0)]`` and copies of one enhancement hold the same tokens."""
    seen: dict[str, Part] = {}
    for s in batch.samples:
        kinds = [p.kind for p in s.parts]
        if kinds != ["ar", "diffusion"] or s.parts[1].parent != 0:
            raise field_error(InvariantError, f"sample[{s.sample_id}].parts", (kinds, s.parts[-1].parent),
                              "['ar', 'diffusion'] with parts[1].parent == 0", "build batches with compose_rollout")
        ar, eid = s.parts[0], enhancement_id(s)
        first = seen.setdefault(eid, ar)
        if first is not ar and (first.text != ar.text or (first.segment is None) != (ar.segment is None) or (
                ar.segment is not None and not first.segment.response_ids.equal(ar.segment.response_ids))):
            raise field_error(InvariantError, f"sample[{s.sample_id}].parts[0]", ar.text,
                              f"the enhancement {eid!r} of its siblings ({first.text!r})",
                              "Samples of one enhancement must share its AR Part")


def enhancement_requests(prompts: Sequence[PromptRecord], grouping: GroupingConfig, sampling: ARSamplingParams, *,
                         policy_version: int, metadata: dict[str, str]) -> SampleBatch:
    """One AR request Sample per enhancement: ids ``<prompt id>/<i>``, group = prompt id."""
    return SampleBatch.from_prompts(prompts, samples_per_prompt=grouping.enhancements_per_prompt, kind="ar",
                                    sampling=sampling, policy_version=policy_version, metadata=metadata)


def image_requests(enhanced: SampleBatch, grouping: GroupingConfig, sampling: DiffusionSamplingParams, *,
                   policy_version: int) -> SampleBatch:
    """Fan every filled enhancement ``p/i`` out into ``G_i`` composed request Samples ``p/i/j``."""
    samples = []
    for s in enhanced.samples:
        ar = s.generated
        if ar.kind != "ar" or ar.segment is None:
            raise field_error(InvariantError, f"sample[{s.sample_id}].generated", ar.kind, "a filled 'ar' Part",
                              "run the enhancer before the image engine")
        for j in range(grouping.images_per_enhancement):
            sid = f"{s.sample_id}/{j}"
            image = Part(kind="diffusion", sample_id=sid, group_id=s.group_id, parent=0, prompt=ar.prompt,
                         targets=dict(ar.targets), sampling=sampling, policy_version=policy_version)
            samples.append(Sample(sample_id=sid, group_id=s.group_id,
                                  parts=[ar.copy(sample_id=sid), image]))
    return SampleBatch(samples=samples, metadata=dict(enhanced.metadata))


def image_noise_index(images: SampleBatch, grouping: GroupingConfig) -> list[int] | None:
    """The noise draw of each image request (``grouping.image_noise``): ``paired`` gives Sample ``p/i/j`` draw j
    of its prompt's noise, so image j of every enhancement starts from the same x_T and SDE noise; ``independent``
    leaves the engine's default (draw ``i * G_i + j``)."""
    if grouping.image_noise == "independent":
        return None
    return [int(s.sample_id.rsplit("/", 1)[1]) for s in images.samples]


def compose_rollout(enhancer: TrainsideAREngine, image: TrainsideDiffusionEngine, prompts: Sequence[PromptRecord],
                    grouping: GroupingConfig, *, ar_sampling: ARSamplingParams, image_sampling: DiffusionSamplingParams,
                    noise: NoiseRecipe, image_version: int, metadata: dict[str, str]) -> tuple[SampleBatch, SampleBatch]:
    """Sample the enhancements, then their images; returns ``(enhancements, composed batch)``.

    ``enhancements``: the AR batch as its engine filled it (``p/i``, the enhancer stack's rows); the composed batch
    holds both Parts per image (``p/i/j``). The image policy version is stamped on the diffusion Parts by the
    image engine (``image_version`` pins the request's)."""
    requests = enhancement_requests(prompts, grouping, ar_sampling, policy_version=enhancer.policy_version,
                                    metadata=metadata)
    enhanced = enhancer.generate(requests)
    images = image_requests(enhanced, grouping, image_sampling, policy_version=image_version)
    composed = image.generate(images, noise=noise, noise_index=image_noise_index(images, grouping))
    check_composed(composed)
    return enhanced, composed
