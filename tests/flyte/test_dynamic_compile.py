"""What a cluster pod of ``grpo_chunk`` returns: the @dynamic compiled into a DynamicJobSpec (no cluster needed).

Local runs execute the dynamic's body eagerly; on a cluster the same body is compiled into a sub-DAG instead.
These tests compile it the way a pod does (TASK_EXECUTION mode) and inspect the nodes."""

from __future__ import annotations

from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekit.core.type_engine import TypeEngine

from tasks.run_types import ClusterConfig, load_run_config
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config import RunConfig
from workflows.grpo import grpo_chunk

HINTS = {"cfg": RunConfig, "cluster": ClusterConfig, "session": str, "ckpt": CheckpointRef, "max_steps": int}


def _compile(overrides: list[str], *, from_step: int = 0, max_steps: int = 0, recipe: str = "tiny-grpo"):
    cfg, cluster = load_run_config(recipe, overrides)
    ref = CheckpointRef(uri=f"s3://b/runs/{cfg.name}/step-{from_step:08d}", run=cfg.name, step=from_step,
                        policy_version=from_step)
    settings = SerializationSettings(project="p", domain="d", version="v1",
                                     image_config=ImageConfig.auto_default_image())
    # a pod compiles its dynamic once per process; flytekit caches the compiled body on the task object
    grpo_chunk._wf = None
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_serialization_settings(settings)) as ctx:
        es = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(es)) as ctx:
            inputs = TypeEngine.dict_to_literal_map(ctx, {"cfg": cfg, "cluster": cluster, "session": "s", "ckpt": ref,
                                                          "max_steps": max_steps}, type_hints=HINTS)
            return grpo_chunk.dispatch_execute(ctx, inputs)


def _targets(spec) -> list[str]:
    return [n.task_node.reference_id.name if n.task_node
            else n.array_node.node.task_node.reference_id.name if n.array_node
            else n.workflow_node.sub_workflow_ref.name for n in spec.nodes]


def test_a_chunk_is_k_steps_then_the_next_chunk():
    spec = _compile(["loop.total_steps=5", "loop.steps_per_chunk=2"])
    names = [t.rsplit(".", 1)[1] for t in _targets(spec)]
    step = ["rollout_one_task", "reward_task", "advantage_task", "train_task", "publish_task", "report_task"]
    assert names == step * 2 + ["grpo_chunk"]
    by_id = {n.id: n for n in spec.nodes}
    reports = [n.id for n in spec.nodes if n.task_node and n.task_node.reference_id.name.endswith("report_task")]
    assert reports[0] in by_id[reports[1]].upstream_node_ids  # reports are serialised
    assert not spec.subworkflows  # one shard: one rollout task, no map task and no join
    roll = next(t for t in spec.tasks if t.id.name == "tasks.rollout.rollout_one_task")
    assert roll.metadata.retries.retries == 2 and roll.metadata.discoverable and roll.container.resources.requests


def test_more_than_one_shard_maps_the_rollout_and_joins_the_shards():
    spec = _compile(["loop.total_steps=2", "loop.rollout_shards=2"])
    names = [t.rsplit(".", 1)[1].split("_task_")[0].removesuffix("_task") + "_task" for t in _targets(spec)]
    assert names == ["map_rollout_task", "join_shards_task", "reward_task", "advantage_task", "train_task",
                     "publish_task", "report_task"] * 2 + ["release_task"]
    arrays = [n for n in spec.nodes if n.array_node is not None]
    assert len(arrays) == 2 and not spec.subworkflows  # the map task is wired in the chunk (recipe resources)
    inner = arrays[0].array_node.node.task_node
    assert inner.reference_id.name.startswith("tasks.rollout.map_rollout_task")
    shards = next(b for b in arrays[0].array_node.node.inputs if b.var == "shard").binding.collection.bindings
    assert [b.scalar.primitive.integer for b in shards] == [0, 1]


def test_filter_groups_wires_dynamic_sampling_between_reward_and_advantage():
    spec = _compile(["loop.total_steps=1", "filter_groups={max_num_gen_batches: 3}", "train.old_logp_source=replay"])
    names = [t.rsplit(".", 1)[1] for t in _targets(spec)]
    assert names == ["rollout_one_task", "reward_task", "dynamic_sampling_task", "advantage_task", "train_task",
                     "publish_task", "report_task", "release_task"]
    task = next(t for t in spec.tasks if t.id.name.endswith("dynamic_sampling_task"))
    reward = next(t for t in spec.tasks if t.id.name.endswith("reward_task"))
    # it samples and scores: a GPU like the rollout and reward tasks, the reward image (a superset of rollout's)
    assert task.container.resources == reward.container.resources and task.container.resources.requests
    assert task.container.image == reward.container.image


def test_cluster_section_picks_the_elastic_train_task():
    spec = _compile(["loop.total_steps=1", "cluster.train_nnodes=2", "cluster.train_nproc_per_node=8"])
    assert "tasks.train.train_elastic_2x8" in _targets(spec)
    task = next(t for t in spec.tasks if t.id.name == "tasks.train.train_elastic_2x8")
    assert task.type == "pytorch" and task.custom["elasticConfig"]["nprocPerNode"] == 8


def test_last_chunk_and_budget():
    # the last chunk: no next chunk; the execution releases the run's lease after the last publish
    spec = _compile(["loop.total_steps=5"], from_step=4)
    assert _targets(spec)[-1].endswith("release_task")
    kind = {n.id: n.task_node.reference_id.name.rsplit(".", 1)[1] for n in spec.nodes}
    release = next(i for i in kind if kind[i] == "release_task")
    assert any(kind[i] == "publish_task" for i in _upstream(spec, release))
    spec = _compile(["loop.total_steps=10", "loop.steps_per_chunk=2"], max_steps=3)
    nxt = spec.nodes[-1]
    assert nxt.task_node.reference_id.name == "workflows.grpo.grpo_chunk"
    budget = next(b for b in nxt.inputs if b.var == "max_steps")
    assert budget.binding.scalar.primitive.integer == 1  # 3 steps asked, 2 in this chunk


def _upstream(spec, node_id: str) -> set[str]:
    """Every node ``node_id`` depends on, transitively."""
    by_id = {n.id: n for n in spec.nodes}
    seen, todo = set(), list(by_id[node_id].upstream_node_ids)
    while todo:
        n = todo.pop()
        if n in by_id and n not in seen:
            seen.add(n)
            todo.extend(by_id[n].upstream_node_ids)
    return seen


def test_lag_one_runs_rollout_n_plus_1_beside_train_n():
    """With async_training.max_policy_lag=1 the rollout of step n+1 depends on the publication of step n-1, never on
    train n; a chunk starting after step 2 reads version 1 (step 3's sampler) from the store. Lag 0: every rollout
    waits for the previous step's publish."""
    spec = _compile(["loop.total_steps=6", "loop.steps_per_chunk=3", "async_training.max_policy_lag=1",
                     "train.old_logp_source=replay", "lm.algorithm.tis_cap=2.0"], from_step=2)
    kind = {n.id: (n.task_node.reference_id.name if n.task_node else n.workflow_node.sub_workflow_ref.name)
            .rsplit(".", 1)[1] for n in spec.nodes}
    rollouts = [i for i in kind if kind[i] == "rollout_one_task"]
    trains = [i for i in kind if kind[i] == "train_task"]
    publishes = [i for i in kind if kind[i] == "publish_task"]
    assert list(kind.values()).count("lagged_version_task") == 1  # step 3 samples with version 1
    # step 3 (first of the chunk) waits for nothing trained in this chunk; step 4 samples with version 2 = ckpt
    assert not _upstream(spec, rollouts[0]) & set(trains) and not _upstream(spec, rollouts[1]) & set(trains)
    # step 5 samples with version 3: after publish 3 (step 3's), independent of train 4
    up5 = _upstream(spec, rollouts[2])
    assert publishes[0] in up5 and trains[1] not in up5
    sync = _compile(["loop.total_steps=6", "loop.steps_per_chunk=3"], from_step=2)
    ids = [n.id for n in sync.nodes if n.task_node and n.task_node.reference_id.name.endswith("rollout_one_task")]
    t = [n.id for n in sync.nodes if n.task_node and n.task_node.reference_id.name.endswith("train_task")]
    assert t[0] in _upstream(sync, ids[1]) and "lagged_version_task" not in str(_targets(sync))
