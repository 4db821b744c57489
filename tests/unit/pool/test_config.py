"""PoolConfig in the RunConfig: defaults, validation, resume rule, and no Ray import unless the pool is used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.resume import rule_for
from unirl_core.pool import ActorResources, PoolConfig

ROOT = Path(__file__).resolve().parents[3]


def test_pods_is_the_default():
    cfg = load_recipe("tiny-grpo")
    assert cfg.pool == PoolConfig() and cfg.pool.execution == "pods" and cfg.pool.address is None


@pytest.mark.parametrize("override, field", [
    ("pool.execution=ray", "pool.execution"),
    ("pool.placement=spread", "pool.placement"),
    ("pool.num_engines=0", "pool.num_engines"),
    ("pool.trainer.num_cpus=-1", "pool.trainer.num_cpus"),
    ("pool.placement_timeout_s=0", "pool.placement_timeout_s"),
    ("pool.publish=nccl", "pool.publish"),
    ("pool.sync_bucket_mb=0", "pool.sync_bucket_mb"),
    ("pool.sync_timeout_s=-1", "pool.sync_timeout_s"),
    ("checkpoint.full_state=sharded", "checkpoint.full_state"),
    ("checkpoint.full_state=dcp", "checkpoint.full_state"),
    ("pool.worker_setup_hook=my_module.setup", "pool.worker_setup_hook"),
    ("pool.trainer_ranks=0", "pool.trainer_ranks=0: expected an integer >= 1"),
    ("pool.trainer_ranks=1.5", "pool.trainer_ranks"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_recipe("tiny-grpo", [override])


def test_every_n_steps_outside_the_pool_is_run_local_only(caplog):
    """run_local keeps its trainer resident (like the pool); a Flyte workflow in pods mode restores the full
    state in every train pod, so its setup derives every_n_steps 1 for it, saying so once."""
    cfg = load_recipe("tiny-grpo", ["checkpoint.every_n_steps=3"])
    assert cfg.checkpoint.every_n_steps == 3 and cfg.pool.execution == "pods"
    with caplog.at_level("WARNING"):
        pods = cfg.checkpoint.for_workflow(cfg.pool.execution)
    assert pods.every_n_steps == 1 and pods.keep_last == cfg.checkpoint.keep_last
    assert "checkpoint.every_n_steps=3 applies in run_local" in caplog.text
    pool = load_recipe("tiny-grpo", ["checkpoint.every_n_steps=3", "pool.execution=pool"])
    assert pool.checkpoint.for_workflow(pool.pool.execution) is pool.checkpoint  # the pool's trainer keeps it


def test_full_state_every_n_steps_in_pool_mode():
    cfg = load_recipe("tiny-grpo", ["pool.execution=pool", "checkpoint.every_n_steps=4",
                                    "checkpoint.full_state=sharded"])
    assert cfg.checkpoint.every_n_steps == 4 and cfg.checkpoint.full_state == "sharded"
    with pytest.raises(ConfigError, match="checkpoint.every_n_steps=0"):
        load_recipe("tiny-grpo", ["pool.execution=pool", "checkpoint.every_n_steps=0"])


SHARED = ["pool.execution=pool", "pool.placement=shared"]


@pytest.mark.parametrize("recipe, extra, field", [
    ("tiny-grpo", ["pool.num_engines=2"], "pool.num_engines=2: expected 1 with pool.placement='shared'"),
    ("tiny-grpo", ["pool.trainer_ranks=2"], "pool.trainer_ranks=2: expected 1 with pool.placement='shared'"),
    ("tiny-grpo", ["async_training.max_policy_lag=1"], "async_training.max_policy_lag=1: expected 0 with pool"),
    ("tiny-flow-grpo", ["train.shard=always"], "train.shard='always': expected 'auto' with pool.placement"),
])
def test_shared_placement_refuses_what_one_module_cannot_do(recipe, extra, field):
    with pytest.raises(ConfigError, match=field):
        load_recipe(recipe, [*SHARED, *extra])


def test_ema_rollouts_run_in_the_pool_only_when_shared():
    assert load_recipe("tiny-nft", SHARED).pool.placement == "shared"  # the trainer's EMA samples
    with pytest.raises(ConfigError, match="pool.execution='pool'.*old_policy='ema'.*pool.placement 'shared'"):
        load_recipe("tiny-nft", ["pool.execution=pool"])
    assert load_recipe("tiny-grpo", ["pool.placement=shared"]).pool.execution == "pods"  # unused in pods mode


VLLM_POOL = ["pool.execution=pool", "pool.publish=object_store"]


VLLM_LORA = ["lm.model.finetune=lora", "lm.model.lora_rank=8", "lm.deployment.sync.method=lora",
             "lm.vllm.weight_sync=lora", "lm.vllm.max_lora_rank=8"]


def test_pool_runs_a_vllm_engine_actor_with_object_store_or_collective_publication():
    cfg = load_recipe("tiny-grpo-vllm", VLLM_POOL)
    assert cfg.pool.execution == "pool" and cfg.lm.deployment.engine == "vllm"
    cfg = load_recipe("tiny-grpo-vllm", ["pool.execution=pool"])  # full weights: the trainer's broadcast
    assert cfg.pool.publish == "collective"
    assert load_recipe("tiny-grpo-vllm", [*VLLM_POOL, *VLLM_LORA]).pool.publish == "object_store"


@pytest.mark.parametrize("extra, match", [
    (VLLM_LORA, r"pool.publish='collective': expected 'object_store' with pool.execution='pool' and "
                r"lm.deployment.engine='vllm' and lm.deployment.sync.method='lora'.*set pool.publish=object_store"),
    (["pool.publish=object_store", "pool.num_engines=2"], r"pool.num_engines=2: expected 1 .*pool.num_engines=1"),
    (["pool.publish=object_store", "pool.placement=shared"], r"pool.placement='shared'.*placement 'colocate'"),
    (["pool.publish=object_store", "async_training.max_policy_lag=1"], r"async_training.max_policy_lag=1"),
    (["pool.publish=object_store", "lm.deployment.mode=colocate"], r"lm.deployment.mode='colocate'.*'separate'"),
    (["pool.publish=object_store", "lm.vllm.base_url=http://127.0.0.1:8000"], r"lm.vllm.base_url=.*leave base_url"),
])
def test_pool_refuses_what_the_vllm_engine_actor_does_not_build(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe("tiny-grpo-vllm", ["pool.execution=pool", *extra])


def test_switching_execution_mode_is_a_safe_resume_change():
    assert rule_for("pool.execution") == "apply" and rule_for("pool.trainer.num_gpus") == "apply"


def test_roles_have_their_own_resources():
    cfg = PoolConfig(trainer=ActorResources(num_cpus=2, num_gpus=1))
    assert cfg.engine.num_cpus == 1.0 and cfg.reward.num_cpus == 0.0 and cfg.trainer.num_gpus == 1


@pytest.mark.slow
def test_the_library_does_not_import_ray_in_pods_mode():
    code = ("import sys; import unirl_core.loop.local, unirl_core.pool, unirl_core.config; "
            "sys.exit(1 if 'ray' in sys.modules else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


def test_worker_setup_hook_runs_in_the_actor_process_and_names_the_field_when_missing(monkeypatch):
    from unirl_core.pool.actors import run_setup_hook

    calls = []
    monkeypatch.setattr(sys.modules[__name__], "_hook_target", lambda: calls.append(1), raising=False)
    run_setup_hook(f"{__name__}:_hook_target")
    assert calls == [1]
    with pytest.raises(ConfigError, match="pool.worker_setup_hook.*PYTHONPATH"):
        run_setup_hook("no_such_module_here:setup")
    with pytest.raises(ConfigError, match="pool.worker_setup_hook"):
        run_setup_hook(f"{__name__}:no_such_function")


def test_trainer_ranks_name_their_actors():
    from unirl_core.pool.group import trainer_names

    assert PoolConfig().trainer_ranks == 1 and trainer_names(1) == ["trainer"]
    assert trainer_names(3) == ["trainer-0", "trainer-1", "trainer-2"]
    assert load_recipe("tiny-grpo", ["pool.trainer_ranks=2"]).pool.trainer_ranks == 2
