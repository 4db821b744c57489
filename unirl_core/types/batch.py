"""SampleBatch: an ordered list of Samples plus string metadata, the unit that travels between phases."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from unirl_core.errors import InvariantError, field_error
from unirl_core.types.sample import Part, PartKind, Sample
from unirl_core.types.sampling import SamplingParams


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One prompt of a data set: the text, its stable id, and reference data for scorers."""

    prompt_id: str
    prompt: str
    targets: dict[str, str] = field(default_factory=dict)


@dataclass(kw_only=True, eq=False)
class SampleBatch:
    """Samples in a fixed order; siblings of one group need not be adjacent."""

    samples: list[Sample] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    """Free-form string metadata (run name, step, policy version, ...); travels in the Arrow schema."""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, s in enumerate(self.samples):
            if not isinstance(s, Sample):
                raise field_error(InvariantError, f"batch.samples[{i}]", type(s).__name__, "a Sample",
                                  "build batches from Sample objects")
            if s.sample_id in seen:
                raise field_error(InvariantError, f"batch.samples[{i}].sample_id", s.sample_id,
                                  "ids unique within a batch", "give every sibling its own sample id")
            seen.add(s.sample_id)
        for k, v in self.metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise field_error(InvariantError, "batch.metadata", (k, v), "str -> str entries",
                                  "convert metadata values with str()")

    @classmethod
    def from_prompts(cls, prompts: Sequence[PromptRecord], *, samples_per_prompt: int, kind: PartKind,
                     sampling: SamplingParams, policy_version: int = 0,
                     metadata: dict[str, str] | None = None) -> SampleBatch:
        """Fork each prompt into a group of ``samples_per_prompt`` request Samples (ids ``<prompt_id>/<k>``)."""
        if samples_per_prompt < 1:
            raise field_error(InvariantError, "samples_per_prompt", samples_per_prompt, "an integer >= 1",
                              "GRPO needs >= 2 siblings per prompt to form an advantage")
        samples = []
        for rec in prompts:
            for k in range(samples_per_prompt):
                sid = f"{rec.prompt_id}/{k}"
                part = Part(kind=kind, sample_id=sid, group_id=rec.prompt_id, prompt=rec.prompt,
                            targets=dict(rec.targets), sampling=sampling, policy_version=policy_version)
                samples.append(Sample(sample_id=sid, group_id=rec.prompt_id, parts=[part]))
        return cls(samples=samples, metadata=dict(metadata or {}))

    def __repr__(self) -> str:
        # short on purpose: flytekit logs every task's inputs with an eager f-string, and the generated
        # repr prints every tensor of every sample (seconds per task for a small image batch)
        return f"SampleBatch({len(self.samples)} samples, {len(self.groups())} groups, metadata={self.metadata})"

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __getitem__(self, index: int | slice) -> Sample | SampleBatch:
        if isinstance(index, slice):
            return SampleBatch(samples=self.samples[index], metadata=dict(self.metadata))
        return self.samples[index]

    @property
    def generated(self) -> list[Part]:
        """The generated Part of every Sample, in batch order."""
        return [s.generated for s in self.samples]

    def groups(self) -> dict[str, list[int]]:
        """Group id -> indices of its samples, in first-seen order."""
        out: dict[str, list[int]] = {}
        for i, s in enumerate(self.samples):
            out.setdefault(s.group_id, []).append(i)
        return out

    def select(self, indices: Sequence[int]) -> SampleBatch:
        """A batch of the samples at ``indices`` (shared, not copied)."""
        n = len(self.samples)
        bad = [i for i in indices if not (-n <= i < n)]
        if bad:
            raise field_error(InvariantError, "indices", bad, f"indices in [0, {n})", "select existing samples")
        return SampleBatch(samples=[self.samples[i] for i in indices], metadata=dict(self.metadata))

    def filter(self, keep: Callable[[Sample], bool]) -> SampleBatch:
        return SampleBatch(samples=[s for s in self.samples if keep(s)], metadata=dict(self.metadata))

    def split(self, size: int) -> list[SampleBatch]:
        """Consecutive chunks of at most ``size`` samples (the last may be shorter)."""
        if size < 1:
            raise field_error(InvariantError, "size", size, "an integer >= 1", "pick a positive chunk size")
        return [self[i:i + size] for i in range(0, len(self.samples), size)]

    @staticmethod
    def concat(batches: Sequence[SampleBatch], metadata: dict[str, str] | None = None) -> SampleBatch:
        """Concatenate batches in order; metadata comes from the first batch unless given."""
        meta = dict(metadata) if metadata is not None else (dict(batches[0].metadata) if batches else {})
        return SampleBatch(samples=[s for b in batches for s in b.samples], metadata=meta)
