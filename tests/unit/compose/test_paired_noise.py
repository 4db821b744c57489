"""``grouping.image_noise``: paired noise gives image j of every enhancement of a prompt the same x_T (the first
latent of its trajectory) and SDE noise, independent noise gives every image its own; and the compose pool settings
that are not built are refused naming their field."""

from __future__ import annotations

import pytest
import torch

from tests.unit.compose.conftest import small_config
from tests.unit.compose.test_engine import _rollout
from unirl_core.compose.engine import enhancement_id
from unirl_core.errors import ConfigError

torch.set_num_threads(1)


def _x_T(batch):
    return {s.sample_id: s.parts[1].segment.latents[0] for s in batch}


def test_paired_noise_shares_image_js_noise_across_a_prompts_enhancements(tmp_path):
    _, _, batch, _ = _rollout(small_config(tmp_path, "grouping.image_noise=paired"))
    x = _x_T(batch)
    for s in batch:
        prompt, i, j = s.sample_id.rsplit("/", 2)
        assert torch.equal(x[s.sample_id], x[f"{prompt}/0/{j}"])  # every enhancement's image j: one x_T
        assert not torch.equal(x[s.sample_id], x[f"{prompt}/{i}/{1 - int(j)}"])  # images of one enhancement differ
        assert enhancement_id(s) == f"{prompt}/{i}"


def test_independent_noise_draws_every_image_its_own(tmp_path):
    _, _, batch, _ = _rollout(small_config(tmp_path, "grouping.image_noise=independent"))
    x = list(_x_T(batch).values())
    assert all(not torch.equal(a, b) for k, a in enumerate(x) for b in x[k + 1:])


@pytest.mark.parametrize("override, names", [
    ("grouping.image_noise=shared", "grouping.image_noise"),
    ("pool.placement=shared", "pool.placement"),
    ("pool.num_engines=2", "pool.num_engines"),
    ("pool.trainer_ranks=2", "pool.trainer_ranks"),
    ("pool.publish=collective", "pool.publish"),
    ("pool.address=127.0.0.1:6379", "pool.address"),
])
def test_unbuilt_compose_settings_are_refused_naming_the_field(tmp_path, override, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        small_config(tmp_path, "pool.execution=pool", override)


def test_pool_execution_is_accepted(tmp_path):
    assert small_config(tmp_path, "pool.execution=pool").pool.publish == "object_store"
