from __future__ import annotations

import pytest
import torch

from unirl_core.errors import ConfigError, InvariantError
from unirl_core.types import (
    ARSamplingParams,
    DiffusionSamplingParams,
    DiffusionSegment,
    NoiseRecipe,
    Part,
    PromptRecord,
    Sample,
    SampleBatch,
    TokenSegment,
)

SIGMAS = (1.0, 0.75, 0.5, 0.25, 0.0)


def test_sigmas_are_pinned_as_float32():
    sp = DiffusionSamplingParams(sigmas=[1.0, 0.6, 0.3, 0.0])
    assert sp.sigmas[1] == float(torch.tensor(0.6, dtype=torch.float32)) and sp.num_steps == 3
    with pytest.raises(ConfigError, match=r"sampling.sigmas=.*float32-representable"):
        DiffusionSamplingParams(sigmas=(1.0, 0.6, 0.0))


@pytest.mark.parametrize("kwargs, field", [
    ({"sigmas": (1.0,)}, "sampling.sigmas"),
    ({"sigmas": (1.0, 0.5, 0.5, 0.0)}, "sampling.sigmas"),
    ({"sigmas": SIGMAS, "sde_type": "euler"}, "sampling.sde_type"),
    ({"sigmas": SIGMAS, "sde_window_size": 9}, "sampling.sde_window_size"),
    ({"sigmas": SIGMAS, "sde_window_size": 2, "sde_window_range": (3, 4)}, "sampling.sde_window_range"),
    ({"sigmas": SIGMAS, "height": 30}, "sampling.height"),
    ({"sigmas": SIGMAS, "noise_level": -1.0}, "sampling.noise_level"),
])
def test_diffusion_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        DiffusionSamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop": ("",)}, "stop"),
])
def test_ar_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"sampling.{field}"):
        ARSamplingParams(**kwargs)


def test_noise_recipe_validates_seed():
    assert NoiseRecipe(base_seed=3).same_noise_per_group is False
    with pytest.raises(ConfigError, match="noise.base_seed"):
        NoiseRecipe(base_seed=-1)


def test_segment_shapes_are_checked():
    ok = dict(latents=torch.zeros(5, 4, 2, 2), log_probs=torch.zeros(4), sigmas=torch.tensor(SIGMAS),
              sde_mask=torch.ones(4, dtype=torch.bool))
    DiffusionSegment(**ok)
    with pytest.raises(InvariantError, match=r"segment.log_probs=\(3,\)"):
        DiffusionSegment(**{**ok, "log_probs": torch.zeros(3)})
    with pytest.raises(InvariantError, match="segment.sigmas.dtype"):
        DiffusionSegment(**{**ok, "sigmas": torch.tensor(SIGMAS, dtype=torch.float64)})
    tok = dict(prompt_ids=torch.zeros(3, dtype=torch.long), response_ids=torch.zeros(2, dtype=torch.long),
               log_probs=torch.zeros(2), response_mask=torch.ones(2, dtype=torch.bool))
    TokenSegment(**tok)
    with pytest.raises(InvariantError, match="segment.response_mask"):
        TokenSegment(**{**tok, "response_mask": torch.ones(3, dtype=torch.bool)})
    with pytest.raises(InvariantError, match="segment.finish_reason"):
        TokenSegment(**tok, finish_reason="eos")


def test_part_kind_matches_segment_and_sampling():
    with pytest.raises(InvariantError, match="part.sampling"):
        Part(kind="ar", sample_id="a/0", group_id="a", sampling=DiffusionSamplingParams(sigmas=SIGMAS))
    with pytest.raises(InvariantError, match="part.sample_id"):
        Part(kind="ar", sample_id="", group_id="a")
    p = Part(kind="ar", sample_id="a/0", group_id="a")
    with pytest.raises(InvariantError, match=r"sample.parts\[0\].sample_id/group_id"):
        Sample(sample_id="b/0", group_id="b", parts=[p])
    with pytest.raises(InvariantError, match=r"parent"):
        Sample(sample_id="a/0", group_id="a", parts=[Part(kind="ar", sample_id="a/0", group_id="a", parent=0)])


def test_fork_groups_select_concat_filter():
    recs = [PromptRecord(prompt_id=f"q{i}", prompt=f"p{i}", targets={"answer": str(i)}) for i in range(3)]
    b = SampleBatch.from_prompts(recs, samples_per_prompt=4, kind="ar", sampling=ARSamplingParams())
    assert len(b) == 12 and list(b.groups()) == ["q0", "q1", "q2"] and b.groups()["q1"] == [4, 5, 6, 7]
    assert b[1].sample_id == "q0/1" and b[1].generated.targets == {"answer": "0"}
    picked = b.select([11, 0])
    assert [s.sample_id for s in picked] == ["q2/3", "q0/0"]
    assert len(SampleBatch.concat(b.split(5))) == 12 and [len(x) for x in b.split(5)] == [5, 5, 2]
    assert len(b.filter(lambda s: s.group_id != "q1")) == 8
    with pytest.raises(InvariantError, match="sample_id"):
        SampleBatch.concat([b, b])
    with pytest.raises(InvariantError, match="indices"):
        b.select([12])
