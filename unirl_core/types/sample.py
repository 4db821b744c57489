"""Sample and Part: the typed rollout boundary every engine takes and returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from torch import Tensor

from unirl_core.errors import InvariantError, field_error
from unirl_core.types.sampling import ARSamplingParams, DiffusionSamplingParams, SamplingParams
from unirl_core.types.segments import DiffusionSegment, Segment, TokenSegment

PartKind = Literal["diffusion", "ar", "input"]
PART_KINDS: tuple[str, ...] = ("diffusion", "ar", "input")

_SEGMENT_FOR = {"diffusion": DiffusionSegment, "ar": TokenSegment}
_SAMPLING_FOR = {"diffusion": DiffusionSamplingParams, "ar": ARSamplingParams}


@dataclass(kw_only=True, eq=False)
class Part:
    """One stage of a Sample: a request before rollout, a filled trajectory after it."""

    kind: PartKind
    """``diffusion`` (image trajectory), ``ar`` (token completion) or ``input`` (a given primitive only)."""
    sample_id: str
    """Id of the Sample this Part belongs to."""
    group_id: str
    """Prompt id shared by the ``samples_per_prompt`` siblings; advantages normalise within it."""
    parent: int | None = None
    """Index of the Part in ``Sample.parts`` whose output conditions this one (prompt enhancement)."""
    prompt: str = ""
    """Raw text primitive."""
    image: bytes | None = None
    """Optional input image primitive as PNG bytes."""
    targets: dict[str, str] = field(default_factory=dict)
    """Reference data for scorers, e.g. ``{"answer": "42"}`` or ``{"ocr_text": "HELLO"}``."""
    sampling: SamplingParams | None = None
    """Pinned sampling parameters (the diffusion sigma schedule lives here)."""
    segment: Segment | None = None
    """Encoded trajectory; None until a rollout engine fills it."""
    conditions: dict[str, Tensor] = field(default_factory=dict)
    """Replay conditions (e.g. prompt embeddings) needed to recompute log-probs at train time."""
    media: bytes | None = None
    """Decoded output image as PNG bytes (diffusion)."""
    text: str | None = None
    """Decoded completion text (AR)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward per scorer component (unweighted)."""
    reward: float | None = None
    """Weighted total reward."""
    valid: bool = True
    """False when a scorer failed under the ``mark_invalid`` policy; excluded from advantages."""
    advantage: float | None = None
    """Normalised advantage the loss multiplies against."""
    policy_version: int = 0
    """Version of the weights that produced this Part's segment."""

    def __post_init__(self) -> None:
        if self.kind not in PART_KINDS:
            raise field_error(InvariantError, "part.kind", self.kind, f"one of {PART_KINDS}",
                              "use 'diffusion', 'ar' or 'input'")
        for name in ("sample_id", "group_id"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise field_error(InvariantError, f"part.{name}", v, "a non-empty string",
                                  "create samples with SampleBatch.from_prompts(...)")
        want_seg = _SEGMENT_FOR.get(self.kind)
        if self.segment is not None and (want_seg is None or not isinstance(self.segment, want_seg)):
            raise field_error(InvariantError, "part.segment", type(self.segment).__name__,
                              f"{want_seg.__name__ if want_seg else 'None'} for kind={self.kind!r}",
                              "fill the segment type that matches the part kind")
        want_sp = _SAMPLING_FOR.get(self.kind)
        if self.sampling is not None and (want_sp is None or not isinstance(self.sampling, want_sp)):
            raise field_error(InvariantError, "part.sampling", type(self.sampling).__name__,
                              f"{want_sp.__name__ if want_sp else 'None'} for kind={self.kind!r}",
                              "pin sampling params of the matching kind")
        if self.reward is not None and not isinstance(self.reward, float):
            self.reward = float(self.reward)
        if self.advantage is not None and not math.isfinite(self.advantage):
            raise field_error(InvariantError, "part.advantage", self.advantage, "a finite number",
                              "check the advantage normalisation (std eps)")

    def copy(self, **changes) -> Part:
        """Shallow copy with fields replaced (tensors are shared, dicts are copied)."""
        base = {"targets": dict(self.targets), "conditions": dict(self.conditions), "rewards": dict(self.rewards)}
        base.update(changes)
        return replace(self, **base)


@dataclass(kw_only=True, eq=False)
class Sample:
    """An ordered chain of Parts; the last generated Part is the one a single-stage loop trains."""

    sample_id: str
    group_id: str
    parts: list[Part]

    def __post_init__(self) -> None:
        if not self.parts:
            raise field_error(InvariantError, "sample.parts", self.parts, "at least one Part",
                              "create samples with SampleBatch.from_prompts(...)")
        for i, p in enumerate(self.parts):
            if p.sample_id != self.sample_id or p.group_id != self.group_id:
                raise field_error(InvariantError, f"sample.parts[{i}].sample_id/group_id",
                                  (p.sample_id, p.group_id), f"({self.sample_id!r}, {self.group_id!r})",
                                  "every Part of a Sample carries the Sample's lineage ids")
            if p.parent is not None and not (0 <= p.parent < i):
                raise field_error(InvariantError, f"sample.parts[{i}].parent", p.parent,
                                  f"an index of an earlier Part (0..{i - 1}) or None", "fix the Part lineage")

    @property
    def generated(self) -> Part:
        """The last Part that is not a plain input (the one rollout fills and training replays)."""
        for p in reversed(self.parts):
            if p.kind != "input":
                return p
        raise field_error(InvariantError, f"sample[{self.sample_id}].parts", [p.kind for p in self.parts],
                          "a 'diffusion' or 'ar' Part", "add a generated Part before rollout")

    def copy(self) -> Sample:
        return Sample(sample_id=self.sample_id, group_id=self.group_id, parts=[p.copy() for p in self.parts])
