"""Hypothesis strategies for random Samples with ragged tensors of every storable dtype."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from unirl_core.types import (
    ARSamplingParams,
    DiffusionSamplingParams,
    DiffusionSegment,
    Part,
    Sample,
    SampleBatch,
    TokenSegment,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8]


def random_tensor(rng: np.random.Generator, shape, dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.from_numpy(np.asarray(rng.random(shape) > 0.5))
    if dtype.is_floating_point:
        # raw random bits exercise every bit pattern (NaN payloads, subnormals, -0.0) for bit-exactness
        nbits = torch.finfo(dtype).bits
        raw = np.asarray(rng.integers(0, 2**nbits, size=shape, dtype=np.uint64)).astype(f"uint{nbits}")
        return torch.from_numpy(raw.view(f"int{nbits}")).view(dtype)
    info = torch.iinfo(dtype)
    return torch.from_numpy(np.asarray(rng.integers(info.min, info.max, size=shape, endpoint=True,
                                                    dtype=np.int64))).to(dtype)


@st.composite
def batches(draw) -> SampleBatch:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_groups = draw(st.integers(0, 3))
    per_group = draw(st.integers(1, 3))
    text = st.text(max_size=20)
    samples = []
    for g in range(n_groups):
        gid = f"g{g}-" + draw(st.text(alphabet="abcé漢", max_size=4))
        for k in range(per_group):
            sid = f"{gid}/{k}"
            kind = draw(st.sampled_from(["diffusion", "ar"]))
            filled = draw(st.booleans())
            if kind == "diffusion":
                t = draw(st.integers(1, 4))
                sp = DiffusionSamplingParams(sigmas=np.linspace(1, 0, t + 1).tolist(),
                                             height=8 * draw(st.integers(1, 4)), width=8)
                seg = DiffusionSegment(
                    latents=random_tensor(rng, (t + 1, draw(st.integers(1, 3)), draw(st.integers(1, 5)),
                                                draw(st.integers(1, 5))), draw(st.sampled_from(DTYPES[:3]))),
                    log_probs=random_tensor(rng, (t,), torch.float32),
                    sigmas=torch.tensor(sp.sigmas, dtype=torch.float32),
                    sde_mask=random_tensor(rng, (t,), torch.bool)) if filled else None
            else:
                sp = ARSamplingParams(temperature=draw(st.floats(0.1, 2.0)), stop=tuple(draw(st.lists(
                    st.text(min_size=1, max_size=3), max_size=2))))
                r = draw(st.integers(0, 12))
                seg = TokenSegment(prompt_ids=random_tensor(rng, (draw(st.integers(0, 9)),), torch.int64),
                                   response_ids=random_tensor(rng, (r,), torch.int64),
                                   log_probs=random_tensor(rng, (r,), torch.float32),
                                   response_mask=random_tensor(rng, (r,), torch.bool),
                                   finish_reason=draw(st.sampled_from(["stop", "length", "abort"]))) \
                    if filled else None
            conds = {draw(st.text(min_size=1, max_size=5)): random_tensor(
                rng, tuple(draw(st.lists(st.integers(0, 4), max_size=3))), draw(st.sampled_from(DTYPES)))
                for _ in range(draw(st.integers(0, 2)))}
            part = Part(kind=kind, sample_id=sid, group_id=gid, prompt=draw(text), sampling=sp, segment=seg,
                        conditions=conds, targets=draw(st.dictionaries(text, text, max_size=2)),
                        media=draw(st.one_of(st.none(), st.binary(max_size=30))),
                        text=draw(st.one_of(st.none(), text)),
                        rewards=draw(st.dictionaries(st.text(min_size=1, max_size=4),
                                                     st.floats(allow_nan=False), max_size=2)),
                        reward=draw(st.one_of(st.none(), st.floats(allow_nan=False))),
                        valid=draw(st.booleans()),
                        advantage=draw(st.one_of(st.none(), st.floats(-5, 5))),
                        policy_version=draw(st.integers(0, 10**6)))
            parts = [part]
            if draw(st.booleans()):
                parts = [Part(kind="input", sample_id=sid, group_id=gid, prompt=draw(text),
                              image=draw(st.binary(max_size=10))), part.copy(parent=0)]
            samples.append(Sample(sample_id=sid, group_id=gid, parts=parts))
    meta = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
    return SampleBatch(samples=samples, metadata=meta)
