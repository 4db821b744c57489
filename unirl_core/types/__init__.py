"""The typed boundary: Sample / Part, segments, sampling params, NoiseRecipe, SampleBatch."""

from unirl_core.types.batch import PromptRecord, SampleBatch
from unirl_core.types.noise import NoiseRecipe
from unirl_core.types.sample import Part, PartKind, Sample
from unirl_core.types.sampling import (
    ARSamplingParams,
    DiffusionSamplingParams,
    SamplingParams,
    SDEType,
    as_float32_tuple,
)
from unirl_core.types.segments import DiffusionSegment, FinishReason, Segment, TokenSegment

__all__ = [
    "ARSamplingParams", "DiffusionSamplingParams", "DiffusionSegment", "FinishReason", "NoiseRecipe", "Part",
    "PartKind", "PromptRecord", "Sample", "SampleBatch", "SamplingParams", "SDEType", "Segment", "TokenSegment",
    "as_float32_tuple",
]
