"""Reward propagation from the image to both Parts, and advantages normalised within each Part's own groups
(hand-computed values), on composed batches built by hand."""

from __future__ import annotations

import math

import pytest
import torch

from unirl_core.advantage.config import AdvantageConfig
from unirl_core.compose.config import GroupingConfig
from unirl_core.compose.credit import assign_compose_advantages, enhancer_batch, image_batch, propagate_rewards
from unirl_core.compose.engine import check_composed, enhancement_id
from unirl_core.errors import InvariantError
from unirl_core.types import DiffusionSegment, Part, Sample, SampleBatch, TokenSegment

torch.set_num_threads(1)


def _token(ids):
    r = len(ids)
    return TokenSegment(prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor(ids), log_probs=torch.zeros(r),
                        response_mask=torch.ones(r, dtype=torch.bool), finish_reason="stop")


def _latents():
    return DiffusionSegment(latents=torch.zeros(3, 1, 2, 2), log_probs=torch.zeros(2), sigmas=torch.tensor([1.0, .5, 0.]),
                            sde_mask=torch.ones(2, dtype=torch.bool))


def composed(rewards: dict[str, list[list[float]]]) -> SampleBatch:
    """``rewards[prompt][i][j]``: the reward of image j of enhancement i of that prompt."""
    samples = []
    for pid, per_enh in rewards.items():
        for i, images in enumerate(per_enh):
            for j, r in enumerate(images):
                sid = f"{pid}/{i}/{j}"
                ar = Part(kind="ar", sample_id=sid, group_id=pid, prompt=f"caption {pid}", text=f"rewrite {pid} {i}",
                          segment=_token([5 + i, 3]))
                img = Part(kind="diffusion", sample_id=sid, group_id=pid, parent=0, prompt=f"caption {pid}",
                           segment=_latents(), reward=r, rewards={"c": r, "z": 0.0})
                samples.append(Sample(sample_id=sid, group_id=pid, parts=[ar, img]))
    return SampleBatch(samples=samples)


def test_image_reward_propagates_as_the_mean_of_an_enhancements_images():
    b = composed({"p": [[1.0, 0.0], [0.5, 0.5], [1.0, 1.0]]})
    metrics = propagate_rewards(b)
    ar = [s.parts[0].reward for s in b.samples]
    assert ar == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0]
    assert b.samples[4].parts[0].rewards == {"c": 1.0, "z": 0.0}
    assert metrics["enhancer/reward/mean"] == pytest.approx(2.0 / 3)
    assert metrics["enhancer/reward/group_range_mean"] == pytest.approx(0.5)


def test_invalid_images_are_left_out_and_an_enhancement_without_valid_images_is_invalid():
    b = composed({"p": [[1.0, 0.0], [0.2, 0.4]]})
    b.samples[1].parts[1].valid = False
    b.samples[2].parts[1].reward = math.nan
    b.samples[3].parts[1].valid = False
    propagate_rewards(b)
    assert b.samples[0].parts[0].reward == 1.0 and b.samples[1].parts[0].reward == 1.0
    assert b.samples[2].parts[0].reward is None and not b.samples[2].parts[0].valid


def test_each_part_normalises_within_its_own_groups():
    cfg = AdvantageConfig(std_scope="group", eps=0.0)
    b = composed({"p": [[1.0, 0.0], [1.0, 1.0]], "q": [[0.0, 0.0], [0.0, 1.0]]})
    propagate_rewards(b)
    metrics = assign_compose_advantages(b, GroupingConfig(enhancements_per_prompt=2, images_per_enhancement=2), cfg)
    # enhancer: group p has enhancement rewards (0.5, 1.0) -> (-1, +1); group q (0.0, 0.5) -> (-1, +1)
    assert [s.parts[0].advantage for s in b.samples] == [-1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
    # images, grouped per enhancement: (1, 0) -> (+1, -1); (1, 1) -> (0, 0); (0, 0) -> (0, 0); (0, 1) -> (-1, +1)
    assert [s.parts[1].advantage for s in b.samples] == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0, -1.0, 1.0]
    assert metrics["enhancer/advantage/num_groups"] == 2 and metrics["image/advantage/num_groups"] == 4

    by_prompt = GroupingConfig(enhancements_per_prompt=2, images_per_enhancement=2, image_groups="prompt")
    assign_compose_advantages(b, by_prompt, cfg)
    # images, grouped per prompt: p (1, 0, 1, 1): mean 0.75, std sqrt(3)/4; q (0, 0, 0, 1): mean 0.25, same std
    s3 = math.sqrt(3) / 4
    want = [0.25 / s3, -0.75 / s3, 0.25 / s3, 0.25 / s3, -0.25 / s3, -0.25 / s3, -0.25 / s3, 0.75 / s3]
    assert [s.parts[1].advantage for s in b.samples] == pytest.approx(want)
    assert metrics["image/advantage/num_groups"] == 4  # the earlier call's metrics are untouched


def test_projections_keep_engine_order_lineage_and_one_row_per_enhancement():
    b = composed({"p": [[1.0, 0.0], [1.0, 1.0]], "q": [[0.0, 0.0], [0.0, 1.0]]})
    enh = enhancer_batch(b)
    assert [s.sample_id for s in enh] == ["p/0", "p/1", "q/0", "q/1"]
    assert [s.group_id for s in enh] == ["p", "p", "q", "q"]
    assert all(s.parts[0].sample_id == s.sample_id and len(s.parts) == 1 for s in enh)
    img = image_batch(b, GroupingConfig(enhancements_per_prompt=2, images_per_enhancement=2))
    assert [s.sample_id for s in img] == [s.sample_id for s in b]
    assert [s.group_id for s in img] == ["p/0", "p/0", "p/1", "p/1", "q/0", "q/0", "q/1", "q/1"]
    assert all(s.parts[0].parent is None and s.parts[0].kind == "diffusion" for s in img)
    assert [enhancement_id(s) for s in b][:3] == ["p/0", "p/0", "p/1"]
    # the composed Parts keep their lineage
    assert all(s.parts[0].sample_id == s.sample_id and s.parts[1].parent == 0 for s in b)


def test_siblings_with_different_enhancement_tokens_are_refused():
    b = composed({"p": [[1.0, 0.0]]})
    b.samples[1].parts[0].segment = _token([9, 3])
    with pytest.raises(InvariantError, match="enhancement 'p/0'"):
        check_composed(b)
