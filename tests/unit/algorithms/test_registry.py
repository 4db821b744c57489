"""Algorithms registered by name: the discriminated ``algorithm`` section, defaults, errors, building."""

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import pytest

from unirl_core.algorithms import registry
from unirl_core.algorithms.cispo import CISPO, CISPOConfig
from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl_core.algorithms.grpo import GRPO, GRPOConfig
from unirl_core.algorithms.registry import algorithm_names, build_algorithm, register_algorithm
from unirl_core.config import RunConfig, from_dict, load_recipe, load_recipe_dict, to_dict
from unirl_core.errors import ConfigError
from unirl_core.runtime import build


def test_builtin_names_per_family():
    assert algorithm_names("lm") == ["cispo", "grpo"]
    assert algorithm_names("diffusion") == ["elbo_pg", "flow_dppo", "flow_grpo", "grpo_guard", "nft"]


def test_recipes_without_a_name_keep_the_family_default():
    lm, diff = load_recipe("tiny-grpo"), load_recipe("tiny-flow-grpo")
    assert "name" not in load_recipe_dict("tiny-grpo")["lm"]["algorithm"]
    assert type(lm.lm.algorithm) is GRPOConfig and type(diff.diffusion.algorithm) is FlowGRPOConfig
    assert type(build.algorithm(lm)) is GRPO and type(build.algorithm(diff)) is FlowGRPO


def test_name_picks_the_config_and_round_trips():
    cfg = load_recipe("tiny-grpo", ["lm.algorithm={name: cispo, epsilon_high: 0.5, mask_truncated_completions: true}"])
    algo = cfg.lm.algorithm
    assert type(algo) is CISPOConfig and algo.epsilon_high == 0.5 and algo.mask_truncated_completions
    assert algo.loss_agg == "dapo"  # CISPO's own default, token-level normalisation
    data = to_dict(cfg)
    assert data["lm"]["algorithm"]["name"] == "cispo"
    assert from_dict(RunConfig, data) == cfg
    assert type(build.algorithm(cfg)) is CISPO


@pytest.mark.parametrize("override, message", [
    (["lm.algorithm.name=ppo"], (r"recipe.lm.algorithm.name='ppo': expected one of \['cispo', 'grpo'\] \(lm "
                                 r"algorithms\); pick a registered name")),
    (["lm.algorithm.name=flow_grpo"], r"'flow_grpo' trains diffusion models; use it in the diffusion section"),
    (["lm.algorithm.name=cispo"], (r"recipe.lm.algorithm.epsilon=0.2: expected a field of algorithm 'cispo' "
                                   r"\(CISPOConfig\); 'epsilon' belongs to grpo: set recipe.lm.algorithm.name to it")),
    (["lm.algorithm.clip_range=0.1"], (r"recipe.lm.algorithm.clip_range=0.1: .*'clip_range' belongs to flow_grpo "
                                       r"\(a diffusion algorithm\) / grpo_guard \(a diffusion algorithm\); remove it")),
    (["lm.algorithm.epsilon_hgih=0.3"], r"recipe.lm.algorithm.epsilon_hgih=0.3: .*grpo's fields: \[.*'epsilon_high'"),
    (["lm.algorithm.name=3"], r"recipe.lm.algorithm.name=3: expected one of"),
    (["lm.algorithm=grpo"], r"recipe.lm.algorithm='grpo': expected a mapping such as \{name: grpo, ...\}"),
])
def test_bad_algorithm_sections_name_field_value_and_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny-grpo", override)


def test_diffusion_section_rejects_lm_algorithms_and_knobs():
    with pytest.raises(ConfigError, match=r"diffusion.algorithm.name='cispo': expected one of \['elbo_pg', 'flow_dppo', 'flow_grpo', 'grpo_guard', 'nft'\]"):
        load_recipe("tiny-flow-grpo", ["diffusion.algorithm.name=cispo"])
    with pytest.raises(ConfigError, match=r"diffusion.algorithm.epsilon=0.2: .*'epsilon' belongs to grpo \(a lm"):
        load_recipe("tiny-flow-grpo", ["diffusion.algorithm.epsilon=0.2"])


def test_a_new_algorithm_is_one_registration():
    @dataclass(frozen=True, kw_only=True)
    class ScaledGRPOConfig(GRPOConfig):
        name: Literal["scaled_grpo"] = field(default="scaled_grpo", init=False)
        scale: float = 1.0

    register_algorithm("scaled_grpo", family="lm", config=ScaledGRPOConfig, build=GRPO)
    try:
        cfg = load_recipe("tiny-grpo", ["lm.algorithm.name=scaled_grpo", "lm.algorithm.scale=2.0"])
        assert cfg.lm.algorithm.scale == 2.0 and isinstance(build_algorithm(cfg.lm.algorithm), GRPO)
        with pytest.raises(ConfigError, match="pick another name or pass replace=True"):
            register_algorithm("scaled_grpo", family="lm", config=dataclasses.make_dataclass(
                "Other", [("name", str, field(default="scaled_grpo", init=False))]), build=GRPO)
    finally:
        registry._ENTRIES.pop("scaled_grpo")


def test_registration_checks_the_discriminator():
    with pytest.raises(ConfigError, match=r"Bad.name=None: expected a dataclass whose name field defaults to 'bad'"):
        register_algorithm("bad", family="lm", config=dataclasses.make_dataclass("Bad", [("x", int, 0)]),
                           build=GRPO)
    with pytest.raises(ConfigError, match=r"algorithm family='video'"):
        register_algorithm("grpo", family="video", config=GRPOConfig, build=GRPO)
    with pytest.raises(ConfigError, match=r"algorithm='dict': expected a registered algorithm config"):
        build_algorithm({"name": "grpo"})
