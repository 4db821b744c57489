"""ComposeRunConfig: the recipe, the derived stack configs and the errors that name the field."""

from __future__ import annotations

import pytest

from tests.unit.compose.conftest import small_config
from unirl_core.compose.config import compose_recipe_names, load_compose_recipe, stack_configs
from unirl_core.errors import ConfigError


def test_recipe_loads_and_derives_one_run_config_per_stack(tmp_path):
    assert "shapes-enhance" in compose_recipe_names()
    cfg = small_config(tmp_path)
    subs = stack_configs(cfg)
    lm, img = subs["enhancer"], subs["image"]
    assert (lm.family, img.family) == ("lm", "diffusion")
    assert (lm.name, img.name) == ("enhancer", "image")
    assert lm.checkpoint.root == img.checkpoint.root == f"{tmp_path}/enh"
    # groups: G_e enhancements per prompt for the enhancer, G_e x G_i images per prompt for the image stack
    assert (lm.data.samples_per_step, img.data.samples_per_step) == (4, 8)
    assert lm.train.micro_batch_size == 4 and img.train.lr == cfg.image.train.lr
    assert cfg.trained == ("enhancer", "image")
    assert small_config(tmp_path, "enhancer.frozen=true").trained == ("image",)


@pytest.mark.parametrize(("override", "names"), [
    ("enhancer.train.micro_batch_size=3", "enhancer.train.micro_batch_size=3"),
    ("image.train.micro_batch_size=3", "image.train.micro_batch_size=3"),
    ("grouping.images_per_enhancement=1", "grouping.images_per_enhancement=1"),
    ("grouping.image_groups=sample", "grouping.image_groups"),
    ("data.samples_per_prompt=8", "data.samples_per_prompt=8"),
    ("data.shapes.num_prompts=1", "data.prompts_per_step=2: expected at most the number of prompts (1 in "
                                  "data.shapes.num_prompts)"),
    ("advantage.drop_zero_std_groups=true", "advantage.drop_zero_std_groups=True"),
    ("enhancer.lm.algorithm.beta=0.1", "enhancer.lm.algorithm.beta=0.1"),
    ("enhancer.warm_start.lr=-1", "enhancer.warm_start.lr=-1"),
    ("checkpoint.every_n_steps=2", "checkpoint.every_n_steps=2: expected 1 in a compose run"),
    ("loop.rollout_with_trainer=true", "loop.rollout_with_trainer=True: expected unset or false in a compose run"),
])
def test_bad_values_fail_naming_the_compose_field(tmp_path, override, names):
    with pytest.raises(ConfigError) as info:
        small_config(tmp_path, override)
    assert names in str(info.value)


def test_both_stacks_frozen_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="enhancer.frozen=True"):
        small_config(tmp_path, "enhancer.frozen=true", "image.frozen=true")


def test_one_image_per_enhancement_with_prompt_groups_is_allowed(tmp_path):
    cfg = small_config(tmp_path, "grouping.images_per_enhancement=1", "grouping.image_groups=prompt",
                       "image.diffusion.engine.forward_batch_size=2", "image.train.micro_batch_size=2")
    assert stack_configs(cfg)["image"].data.samples_per_step == 4


def test_unknown_key_names_the_dotted_path():
    with pytest.raises(ConfigError, match="grouping.images_per_prompt"):
        load_compose_recipe("shapes-enhance", ["grouping.images_per_prompt=3"])


def test_colour_recipe_prompts_leave_the_colour_to_the_enhancer():
    """shapes-enhance-colour: the enhancer sees "two circles", the reward wants "two blue circles"."""
    from unirl_core.runtime import build

    cfg = load_compose_recipe("shapes-enhance-colour")
    assert "shapes-enhance-colour" in compose_recipe_names() and cfg.trained == ("enhancer",)
    records = build.dataset(stack_configs(cfg)["enhancer"]).records
    assert records and all(r.targets["caption"].split() == [*r.prompt.split()[:1], "blue", *r.prompt.split()[1:]]
                           for r in records)
