"""The composed engine on the real models (tiny shapes-words LM, shipped shapes-sd3): grouping, lineage and
conditioning of Part 1 on Part 0, and the Arrow round trip of the composed batch."""

from __future__ import annotations

import dataclasses

import torch

from unirl_core.compose.config import stack_configs
from unirl_core.compose.engine import compose_rollout, enhancement_id
from unirl_core.io import read_batch, write_batch
from unirl_core.runtime import build
from unirl_core.loop.phases import step_prompts
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.rollout.diffusion import TrainsideDiffusionEngine
from unirl_core.types import NoiseRecipe

torch.set_num_threads(1)


def _rollout(cfg):
    subs = stack_configs(cfg)
    lm, img = build.fresh_bundle(subs["enhancer"]), build.fresh_bundle(subs["image"])
    enhancer = TrainsideAREngine(lm, dataclasses.replace(subs["enhancer"].lm.engine, seed=3), policy_version=0)
    image = TrainsideDiffusionEngine(img, subs["image"].diffusion.engine, policy_version=0)
    prompts = step_prompts(subs["enhancer"], 1)
    enhanced, batch = compose_rollout(
        enhancer, image, prompts, cfg.grouping, ar_sampling=subs["enhancer"].lm.sampling,
        image_sampling=subs["image"].diffusion.sampling.params("sd3", 1), noise=NoiseRecipe(base_seed=5),
        image_version=0, metadata={"step": "1"})
    return prompts, enhanced, batch, img


def test_grouping_lineage_and_conditioning(small, tmp_path):
    prompts, enhanced, batch, img = _rollout(small)
    # G_e = 2 enhancements per prompt, G_i = 2 images per enhancement: ids p/i/j in engine order
    assert [s.sample_id for s in enhanced] == [f"{p.prompt_id}/{i}" for p in prompts for i in range(2)]
    assert [s.sample_id for s in batch] == [f"{p.prompt_id}/{i}/{j}" for p in prompts for i in range(2) for j in range(2)]
    for s in batch:
        ar, image = s.parts
        assert (ar.kind, image.kind, image.parent) == ("ar", "diffusion", 0)
        assert s.group_id == ar.group_id == image.group_id == s.sample_id.split("/")[0]
        src = enhanced[[e.sample_id for e in enhanced].index(enhancement_id(s))].generated
        assert ar.text == src.text and torch.equal(ar.segment.response_ids, src.segment.response_ids)
        # scored against the original caption, conditioned on the enhancement
        assert image.prompt == ar.prompt
        want = img.encode_text([ar.text])[0]["prompt_embeds"]
        assert torch.equal(image.conditions["prompt_embeds"], want.cpu())
        assert image.media and image.segment.latents.shape[0] == 5
    # the enhancements differ at temperature 1 (an untrained LM), so Part 1 really follows Part 0
    assert len({s.parts[0].text for s in batch}) > 1
    path = tmp_path / "composed.arrow"
    write_batch(batch, path)
    back = read_batch(path)
    assert [(s.sample_id, [p.kind for p in s.parts], s.parts[1].parent, s.parts[0].text) for s in back] == \
        [(s.sample_id, ["ar", "diffusion"], 0, s.parts[0].text) for s in batch]
    assert all(torch.equal(a.parts[1].segment.latents, b.parts[1].segment.latents) for a, b in zip(back, batch))
