"""Engine settings the loop would ignore are refused, naming the field and where the setting lives instead."""

from __future__ import annotations

import pytest

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError

SGLANG = ["lm.deployment.engine=sglang", "lm.vllm=null", "lm.sglang.model=/models/policy",
          "lm.sglang.base_url=http://10.0.0.5:30000"]


@pytest.mark.parametrize("override, fix", [
    ("lm.engine.system_prompt=Be brief.", "set lm.vllm.prompt.system_prompt instead"),
    ("lm.engine.apply_chat_template=false", "set lm.vllm.prompt.apply_chat_template instead"),
    ("lm.engine.ignore_eos=true", "set lm.vllm.ignore_eos instead"),
    ("lm.engine.forward_batch_size=8", "batches requests itself"),
    ("lm.engine.decoder=lean", "no counterpart in the vllm engine; remove it"),
])
def test_trainside_engine_settings_are_refused_with_a_dedicated_engine(override, fix):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}=.*expected the default .* lm.deployment.engine='vllm'") as e:
        load_recipe("tiny-grpo-vllm", [override])
    assert fix in str(e.value)


def test_sglang_gets_its_own_fixes_and_the_dedicated_prompt_format_is_accepted():
    with pytest.raises(ConfigError, match="set lm.sglang.prompt.system_prompt instead"):
        load_recipe("tiny-grpo-vllm", [*SGLANG, "lm.engine.system_prompt=x"])
    with pytest.raises(ConfigError, match="sglang engine does not support ignore_eos"):
        load_recipe("tiny-grpo-vllm", [*SGLANG, "lm.engine.ignore_eos=true"])
    cfg = load_recipe("tiny-grpo-vllm", ["lm.vllm.prompt.system_prompt=Be brief."])
    assert cfg.lm.vllm.prompt.system_prompt == "Be brief."
    # trainside runs keep their engine settings
    assert load_recipe("tiny-grpo", ["lm.engine.system_prompt=Be brief."]).lm.engine.system_prompt == "Be brief."


@pytest.mark.parametrize("recipe, override", [
    ("tiny-grpo", "lm.engine.seed=3"),
    ("tiny-flow-grpo", "diffusion.engine.seed=3"),
    ("tiny-grpo-vllm", "lm.engine.seed=3"),
    ("tiny-grpo-vllm", "lm.vllm.seed=3"),
])
def test_engine_seeds_the_loop_replaces_are_refused(recipe, override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=3: expected the default 0 .*stable_seed\(loop.seed, 'rollout', "
                                          r"step, shard\).*set loop.seed"):
        load_recipe(recipe, [override])
    assert load_recipe(recipe, ["loop.seed=3"]).loop.seed == 3
