"""The pool's SampleBatch transport (Arrow IPC bytes instead of pickle): bit-exact for full batches and
projections, metadata kept, and the bytes carry their decoder (a receiver needs no registration)."""

from __future__ import annotations

import pickle

import torch

from tests.unit.pool.test_projection import _diffusion_batch
from unirl_core.pool import transport
from unirl_core.pool.projection import PROJECTION_KEY, project
from unirl_core.types import Part, Sample, SampleBatch, TokenSegment

torch.set_num_threads(1)


def _token_batch() -> SampleBatch:
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(3):
        seg = TokenSegment(prompt_ids=torch.randint(0, 50, (5,), generator=g),
                           response_ids=torch.randint(0, 50, (4,), generator=g),
                           log_probs=torch.randn(4, generator=g), response_mask=torch.ones(4, dtype=torch.bool),
                           finish_reason="length")
        part = Part(kind="ar", sample_id=f"g0/{i}", group_id="g0", prompt="2+2", segment=seg, text="four",
                    rewards={"acc": 0.5}, reward=0.5, advantage=-0.25, policy_version=7)
        samples.append(Sample(sample_id=part.sample_id, group_id=part.group_id, parts=[part]))
    return SampleBatch(samples=samples, metadata={"step": "8", "run": "t"})


def _same(a: SampleBatch, b: SampleBatch) -> bool:
    if a.metadata != b.metadata or [s.sample_id for s in a.samples] != [s.sample_id for s in b.samples]:
        return False
    for pa, pb in zip(a.generated, b.generated):
        for name in ("kind", "group_id", "prompt", "media", "text", "rewards", "reward", "advantage", "valid",
                     "policy_version"):
            if getattr(pa, name) != getattr(pb, name):
                return False
        ta, tb = vars(pa.segment), vars(pb.segment)
        for k, v in ta.items():
            if isinstance(v, torch.Tensor) and not (v.dtype == tb[k].dtype and v.shape == tb[k].shape
                                                    and torch.equal(v, tb[k])):
                return False
        if pa.conditions.keys() != pb.conditions.keys() or not all(
                torch.equal(pa.conditions[k], pb.conditions[k]) for k in pa.conditions):
            return False
    return True


def test_full_batches_and_projections_round_trip_bitexactly():
    for batch in (_diffusion_batch(), project(_diffusion_batch()), _token_batch()):
        back = transport.decode(transport.encode(batch))
        assert _same(batch, back)
    back = transport.decode(transport.encode(project(_diffusion_batch())))
    assert back.metadata[PROJECTION_KEY] == "latents,conditions"
    assert tuple(back.generated[0].segment.latents.shape) == (4, 0, 0, 0)


def test_bf16_tensors_keep_their_bits():
    batch = _diffusion_batch()
    for p in batch.generated:
        p.segment.latents = p.segment.latents.to(torch.bfloat16)
    back = transport.decode(transport.encode(batch))
    assert all(b.segment.latents.dtype == torch.bfloat16 and torch.equal(a.segment.latents, b.segment.latents)
               for a, b in zip(batch.generated, back.generated))


def test_the_decoder_travels_by_reference():
    """What Ray's registered serializer ships: (decode, bytes) pickles and unpickles in any process."""
    batch = _token_batch()
    shipped = pickle.loads(pickle.dumps((transport.decode, transport.encode(batch))))
    assert _same(batch, shipped[0](shipped[1]))
