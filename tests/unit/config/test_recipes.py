from __future__ import annotations

import pytest

from unirl_core.config import RunConfig, from_dict, load_recipe, load_recipe_dict, recipe_names, to_dict
from unirl_core.errors import ConfigError


def test_every_shipped_recipe_loads_and_round_trips():
    assert {"tiny-flow-grpo", "tiny-grpo"} <= set(recipe_names())
    for name in recipe_names():
        cfg = load_recipe(name)
        assert isinstance(cfg, RunConfig) and cfg.name
        again = from_dict(RunConfig, to_dict(cfg))
        assert to_dict(again) == to_dict(cfg)


def test_overrides_are_typed_and_applied():
    cfg = load_recipe("tiny-grpo", ["train.lr=1e-5", "loop.total_steps=3", 'lm.sampling.stop=["\\n"]'])
    assert cfg.train.lr == 1e-5 and cfg.loop.total_steps == 3 and cfg.lm.sampling.stop == ("\n",)


@pytest.mark.parametrize("override, message", [
    (["train.lrr=1"], r"recipe.train.lrr=1: expected a field of TrainConfig; valid fields: \[.*'lr'"),
    (["train.lr=fast"], r"recipe.train.lr='fast': expected a number"),
    (["lm.algorithm.loss_agg=mean"], r"recipe.lm.algorithm.loss_agg='mean': expected one of \('grpo', 'dapo', "),
    (["family=video"], r"recipe.family='video'"),
    (["train.micro_batch_size=5"], r"train.micro_batch_size=5: expected a divisor of samples per step \(32\)"),
    (["train.micro_batch_size=8"], r"equal to lm.engine.forward_batch_size \(16\)"),
    (["lm.algorithm.loss_agg=dapo", "advantage.drop_zero_std_groups=true"], r"drop_zero_std_groups"),
    (["loop.rollout_shards=3"], r"loop.rollout_shards=3: expected a divisor of data.prompts_per_step=4"),
    (["data.toy.num_prompts=3"],
     r"data.prompts_per_step=4: expected at most the number of prompts \(3 in data.toy.num_prompts\)"),
    (["train.lr"], r"override='train.lr': expected 'dotted.key=value'"),
])
def test_bad_recipe_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny-grpo", override)


def test_inline_prompts_must_number_at_least_prompts_per_step():
    # shapes-count-climb lists 4 inline prompts: 5 per step would repeat a prompt in every step. Refused at load.
    with pytest.raises(ConfigError) as info:
        load_recipe("shapes-count-climb", ["data.prompts_per_step=5", "train.micro_batch_size=8"])
    msg = str(info.value)
    assert msg.startswith("data.prompts_per_step=5: expected at most the number of prompts (4 in data.prompts)")
    assert "set data.prompts_per_step to at most 4, or add prompts to data.prompts" in msg
    # 3 of 4: the steps spanning two epochs of the shuffled stream draw no prompt twice (PromptDataset.epoch_order).
    assert load_recipe("shapes-count-climb", ["data.prompts_per_step=3",
                                              "train.micro_batch_size=8"]).data.prompts_per_step == 3


def test_shapes_prompt_count_is_checked_at_load():
    with pytest.raises(ConfigError, match=r"data.prompts_per_step=4: expected at most the number of prompts "
                                          r"\(3 in data.shapes.num_prompts\)"):
        load_recipe("shapes-nft", ["data.shapes.num_prompts=3"])
    assert load_recipe("shapes-nft", ["data.shapes.num_prompts=6"]).data.section("shapes").num_prompts == 6


def test_missing_section_and_unknown_recipe():
    data = load_recipe_dict("tiny-grpo")
    data.pop("lm")
    with pytest.raises(ConfigError, match=r"lm=None: expected a 'lm' section for family='lm'"):
        from_dict(RunConfig, data, "recipe")
    with pytest.raises(ConfigError, match=r"recipe='nope': expected a shipped recipe"):
        load_recipe("nope")


def test_replay_source_allows_different_slicing():
    cfg = load_recipe("tiny-grpo", ["train.micro_batch_size=8", "train.old_logp_source=replay"])
    assert cfg.train.micro_batch_size == 8


def test_recipe_file_path(tmp_path):
    import yaml

    data = load_recipe_dict("tiny-grpo")
    data["name"] = "mine"
    p = tmp_path / "mine.yaml"
    p.write_text(yaml.safe_dump(data))
    assert load_recipe(str(p)).name == "mine"
