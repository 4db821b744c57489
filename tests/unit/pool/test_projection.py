"""The pool's projection: what a pool rollout emits, and the full batch the trainer gets back."""

from __future__ import annotations

import pytest
import torch

from unirl_core.errors import NumericsError
from unirl_core.io.ipc import read_batch, write_batch
from unirl_core.pool.projection import PROJECTION_KEY, for_training, project
from unirl_core.types import DiffusionSegment, Part, Sample, SampleBatch, TokenSegment


def _diffusion_batch(n: int = 4, steps: int = 3) -> SampleBatch:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        seg = DiffusionSegment(latents=torch.randn(steps + 1, 4, 8, 8, generator=g),
                               log_probs=torch.randn(steps, generator=g), sigmas=torch.linspace(1, 0, steps + 1),
                               sde_mask=torch.ones(steps, dtype=torch.bool))
        part = Part(kind="diffusion", sample_id=f"g{i // 2}/{i % 2}", group_id=f"g{i // 2}", prompt="a cat",
                    segment=seg, conditions={"prompt_embeds": torch.randn(5, 16, generator=g)}, media=b"\x89PNG",
                    policy_version=3)
        samples.append(Sample(sample_id=part.sample_id, group_id=part.group_id, parts=[part]))
    return SampleBatch(samples=samples, metadata={"step": "4"})


def test_projection_drops_latents_and_conditions_and_survives_arrow(tmp_path):
    full = _diffusion_batch()
    proj = project(full)
    for a, b in zip(full.generated, proj.generated):
        assert tuple(b.segment.latents.shape) == (4, 0, 0, 0) and b.segment.latents.dtype == a.segment.latents.dtype
        assert b.conditions == {} and b.media == a.media and b.policy_version == 3
        assert torch.equal(a.segment.log_probs, b.segment.log_probs) and torch.equal(a.segment.sigmas, b.segment.sigmas)
    assert full.generated[0].conditions and full.generated[0].segment.latents.numel() > 0  # the input is untouched
    write_batch(proj, tmp_path / "p.arrow")
    back = read_batch(tmp_path / "p.arrow")
    assert back.metadata[PROJECTION_KEY] == "latents,conditions"
    assert tuple(back.generated[0].segment.latents.shape) == (4, 0, 0, 0)
    write_batch(full, tmp_path / "f.arrow")
    latent_bytes = sum(p.segment.latents.numel() * 4 for p in full.generated)
    assert (tmp_path / "f.arrow").stat().st_size - (tmp_path / "p.arrow").stat().st_size >= latent_bytes


def test_for_training_carries_scores_onto_the_full_batch_in_scored_order():
    full = _diffusion_batch()
    scored = project(full).select([3, 2, 1])  # e.g. a dropped sample, another order
    scored.metadata["unirl.tracker_state"] = "{}"
    for k, p in enumerate(scored.generated):
        p.reward, p.rewards, p.advantage, p.valid = float(k), {"jpeg": float(k)}, k - 1.0, k != 1
    out = for_training(full, scored)
    assert [s.sample_id for s in out] == [s.sample_id for s in scored]
    for o, s in zip(out.generated, scored.generated):
        assert (o.reward, o.rewards, o.advantage, o.valid) == (s.reward, s.rewards, s.advantage, s.valid)
        assert o.segment.latents.numel() > 0 and "prompt_embeds" in o.conditions
    assert out.metadata == {"step": "4", "unirl.tracker_state": "{}"}
    assert full.generated[3].advantage is None  # the pool's copy is not mutated


def test_for_training_fails_closed_on_another_batch():
    full, other = _diffusion_batch(), _diffusion_batch()
    other.generated[0].segment.log_probs += 1e-7
    with pytest.raises(NumericsError, match="log_probs"):
        for_training(full, project(other))
    with pytest.raises(NumericsError, match="g9/0"):
        bad = project(full)
        bad.samples[0].sample_id = bad.samples[0].parts[0].sample_id = "g9/0"
        for_training(full, bad)


def test_token_segments_are_kept_whole():
    seg = TokenSegment(prompt_ids=torch.arange(3), response_ids=torch.arange(4), log_probs=torch.zeros(4),
                       response_mask=torch.ones(4, dtype=torch.bool))
    part = Part(kind="ar", sample_id="g/0", group_id="g", segment=seg, text="12")
    proj = project(SampleBatch(samples=[Sample(sample_id="g/0", group_id="g", parts=[part])]))
    assert proj.generated[0].segment is seg and proj.generated[0].text == "12"
