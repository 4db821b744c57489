"""Plugins: recipes of examples/ found by name, a recipe's plugins imported before validation, one clear error for
a name nobody registered."""

import pytest
import yaml

from unirl_core.config import from_dict, load_recipe, recipe_names, to_dict
from unirl_core.config.run import RunConfig
from unirl_core.errors import ConfigError
from unirl_core.plugins import plugin_modules


def test_example_recipes_are_found_by_name_and_name_their_plugin():
    assert {"examples.shapes", "examples.toy_sums", "examples.agentic", "examples.compose_enhance"} <= {
        name for name, _ in plugin_modules()}
    assert {"shapes-flow-grpo-count", "toy-sums", "tiny-agent-calc", "tiny-grpo"} <= set(recipe_names())
    cfg = load_recipe("shapes-flow-grpo-count")
    assert cfg.plugins == ("examples.shapes",) and cfg.diffusion.model.source == "shapes-sd3"
    assert load_recipe("tiny-grpo").plugins == ()
    again = from_dict(RunConfig, to_dict(cfg), "RunConfig")  # what a Flyte task rebuilds in its own process
    assert again == cfg


def test_a_users_recipe_file_names_its_plugins(tmp_path):
    data = yaml.safe_load(open(_path("shapes-nft")))
    data["plugins"] = ["examples.shapes"]
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_recipe(str(path), ["data.shapes.num_prompts=8"])
    assert cfg.plugins == ("examples.shapes",) and cfg.data.section("shapes").num_prompts == 8
    data["plugins"] = ["no_such_plugin_module"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"plugins\[0\]='no_such_plugin_module': expected an importable module"):
        load_recipe(str(path))


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.source=nope"], r"recipe.data.source='nope': expected one of \['inline', 'file', .*'shapes'.*'toy_arithmetic'"),
    (["data.nope={a: 1}"], r"recipe.data.nope=\{'a': 1\}: expected a field of DataConfig or the section of a registered "
                           r"prompt source.*registered sections: \[.*'shapes', 'toy'\]"),
    (["lm.agent.env={name: chess}"], r"lm.agent.env.name='chess': expected one of \[.*'calculator'"),
])
def test_unknown_names_say_the_field_the_value_and_the_registered_names(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny-grpo", overrides)


def _path(name):
    from unirl_core.config.recipes import recipe_path

    return recipe_path(name)
