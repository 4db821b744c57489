"""RunConfig / CheckpointRef / ClusterConfig as Flyte types."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from flytekit import task, workflow
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import TypeEngine

from tasks.run_types import (
    ClusterConfig,
    HashedCheckpointRef,
    checkpoint_digest,
    load_run_config,
    run_config_json,
)
from unirl_core.checkpoint import CheckpointRef, CheckpointStore
from unirl_core.config import RunConfig, load_recipe, load_recipe_dict
from unirl_core.errors import ConfigError


@pytest.mark.parametrize("recipe", ["tiny-flow-grpo", "tiny-grpo"])
def test_run_config_literal_roundtrips_and_is_canonical(recipe):
    ctx = FlyteContextManager.current_context()
    cfg = load_recipe(recipe)
    lt = TypeEngine.to_literal_type(RunConfig)
    lit = TypeEngine.to_literal(ctx, cfg, RunConfig, lt)
    assert lt.simple is not None and lit.scalar.primitive.string_value == run_config_json(cfg)
    back = TypeEngine.to_python_value(ctx, lit, RunConfig)
    assert back == cfg and back is not cfg
    # equal configs give byte-equal literals (stable cache keys); a changed field changes them
    again = TypeEngine.to_literal(ctx, load_recipe(recipe), RunConfig, lt)
    assert again.scalar.primitive.string_value == lit.scalar.primitive.string_value
    other = TypeEngine.to_literal(ctx, load_recipe(recipe, ["loop.seed=7"]), RunConfig, lt)
    assert other.scalar.primitive.string_value != lit.scalar.primitive.string_value


def test_run_config_literal_is_revalidated():
    ctx = FlyteContextManager.current_context()
    lit = TypeEngine.to_literal(ctx, load_recipe("tiny-grpo"), RunConfig, TypeEngine.to_literal_type(RunConfig))
    data = json.loads(lit.scalar.primitive.string_value)
    data["loop"]["total_steps"] = 0
    lit.scalar.primitive._string_value = json.dumps(data)
    with pytest.raises(ConfigError, match="loop.total_steps"):
        TypeEngine.to_python_value(ctx, lit, RunConfig)


@task
def _pass(cfg: RunConfig, ref: CheckpointRef) -> RunConfig:
    assert isinstance(ref, CheckpointRef) and ref.step == 3
    return cfg


@workflow
def _wf(cfg: RunConfig, ref: CheckpointRef) -> RunConfig:
    return _pass(cfg=cfg, ref=ref)


def test_types_travel_between_tasks():
    cfg = load_recipe("tiny-flow-grpo")
    out = _wf(cfg=cfg, ref=CheckpointRef(uri="/x/r/step-00000003", run="r", step=3, policy_version=3))
    assert out == cfg


def test_cluster_section_is_split_off(tmp_path):
    recipe = tmp_path / "r.yaml"
    cluster_yaml = "cluster: {train_nnodes: 2, train_nproc_per_node: 8}\n"
    recipe.write_text(yaml.safe_dump(load_recipe_dict("tiny-grpo")) + cluster_yaml)
    cfg, cluster = load_run_config(str(recipe), [])
    assert cluster == ClusterConfig(train_nnodes=2, train_nproc_per_node=8) and cfg.name == "tiny-grpo"
    _, cl = load_run_config("tiny-grpo", ["cluster.train_nproc_per_node=4"])
    assert (cl.train_nnodes, cl.train_nproc_per_node) == (1, 4)
    with pytest.raises(ConfigError, match="train_nnodes x train_nproc_per_node"):
        load_run_config("tiny-grpo", ["cluster.train_nproc_per_node=3"])
    with pytest.raises(ConfigError, match="gpus"):
        load_run_config("tiny-grpo", ["cluster.gpus=3"])


def test_checkpoint_digest_follows_content_not_write_time(tmp_path):
    store = CheckpointStore(str(tmp_path), "run")
    w = {"w": torch.arange(4, dtype=torch.float32)}
    a = store.save(1, weights=w, policy_version=1)
    d1 = checkpoint_digest(a)
    store.save(1, weights=w, policy_version=1, overwrite=True)  # same bytes, new manifest write time
    assert checkpoint_digest(a) == d1
    store.save(1, weights={"w": torch.ones(4)}, policy_version=1, overwrite=True)
    assert checkpoint_digest(a) != d1
    ctx = FlyteContextManager.current_context()
    lit = TypeEngine.to_literal(ctx, a, HashedCheckpointRef, TypeEngine.to_literal_type(CheckpointRef))
    assert lit.hash == checkpoint_digest(a)
