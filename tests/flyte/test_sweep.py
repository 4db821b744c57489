"""The sweep workflow and the shared-pool LaunchPlan attach their runs to a named pool (``pool.name``): their
overrides load into valid LoRA run configs, one name per run, and a full fine-tune is refused naming the field."""

from __future__ import annotations

import pytest

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from workflows.schedules import SHARED_LORA_POOL, nightly_lora_shared_pool
from workflows.sweep import variant_runs


def test_sweep_runs_attach_to_the_named_pool_each_its_own_run():
    runs = variant_runs("tiny-grpo", ["lm.model.finetune=lora"], [["train.lr=1e-3"], ["train.lr=3e-3"]], "sweep-a",
                        "127.0.0.1:6379")
    cfgs = [load_recipe("tiny-grpo", run) for run in runs]
    assert [c.name for c in cfgs] == ["sweep-a-0", "sweep-a-1"]
    assert [c.train.lr for c in cfgs] == [1e-3, 3e-3]
    assert {(c.pool.execution, c.pool.name, c.pool.address) for c in cfgs} == {("pool", "sweep-a", "127.0.0.1:6379")}


def test_a_full_fine_tune_sweep_is_refused_naming_pool_name():
    (run,) = variant_runs("tiny-grpo", [], [[]], "sweep-a", "127.0.0.1:6379")
    with pytest.raises(ConfigError, match=r"pool.name.*finetune='full'"):
        load_recipe("tiny-grpo", run)


def test_the_shared_pool_launch_plan_names_its_pool():
    overrides = nightly_lora_shared_pool.parameters.parameters["overrides"].default.collection.literals
    values = [lit.scalar.primitive.string_value for lit in overrides]
    assert f"pool.name={SHARED_LORA_POOL}" in values and "pool.execution=pool" in values
    cfg = load_recipe("sd35m-pickscore", values)
    assert cfg.pool.name == SHARED_LORA_POOL and cfg.diffusion.model.finetune == "lora"
