"""Pod resources per recipe (tasks/resources.py): what the compiled chunk of each recipe asks of the cluster (the node
overrides a pod of ``grpo_chunk`` returns), the defaults per shape, and bad values named by field."""

from __future__ import annotations

import pytest

from tasks import resources
from tasks.common import DEFAULT_ACCELERATOR
from tasks.run_types import load_run_config
from tests.flyte.test_dynamic_compile import _compile
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError

ROLE_OF = {"rollout_one_task": "rollout", "map_rollout_task": "rollout", "reward_task": "reward",
           "train_task": "train", "eval_task": "rollout", "dynamic_sampling_task": "rollout"}


def _pods(spec) -> dict[str, dict]:
    """Role -> {"requests": {name: value}, "limits": {...}, "accelerator": device | None} of the chunk's nodes (every
    node of a role asks for the same)."""
    out: dict[str, dict] = {}
    for n in spec.nodes:
        task = n.array_node.node.task_node if n.array_node is not None else n.task_node
        if task is None:
            continue
        name = task.reference_id.name.rsplit(".", 1)[1]
        name = "map_rollout_task" if name.startswith("map_rollout_task") else name
        if name not in ROLE_OF:
            continue
        o = task.overrides
        res = o.resources
        ext = o.extended_resources
        pod = {"requests": {r.name: r.value for r in res.requests}, "limits": {r.name: r.value for r in res.limits},
               "accelerator": ext.gpu_accelerator.device if ext is not None and ext.gpu_accelerator else None}
        out.setdefault(ROLE_OF[name], pod)
        assert out[ROLE_OF[name]] == pod, name
    return out


def _named(pod: dict) -> dict:
    from flytekit.models.task import Resources as R

    names = {v: k for k, v in vars(R.ResourceName).items() if isinstance(v, int)}
    return {"requests": {names[k]: v for k, v in pod["requests"].items()},
            "limits": {names[k]: v for k, v in pod["limits"].items()}, "accelerator": pod["accelerator"]}


def test_a_tiny_recipe_runs_on_cpu_pods_without_an_accelerator():
    pods = {role: _named(p) for role, p in _pods(_compile(["loop.total_steps=1"])).items()}
    assert set(pods) == {"rollout", "reward", "train"}
    for role, pod in pods.items():
        assert pod == {"requests": {"CPU": "2", "MEMORY": "8Gi", "GPU": "0"},
                       "limits": {"MEMORY": "16Gi", "GPU": "0"}, "accelerator": None}, role


@pytest.mark.parametrize("recipe", ["sd35m-pickscore", "sd35m-ocr", "sd35m-elbo-pg", "qwen3-math"])
def test_each_cluster_recipe_gets_the_pods_its_cluster_section_declares(recipe):
    spec = _compile(["loop.total_steps=1"], recipe=recipe)
    pods = {role: _named(p) for role, p in _pods(spec).items()}
    _, cluster = load_run_config(recipe, [])
    for role in ("rollout", "reward", "train"):
        want = getattr(cluster, role)
        assert pods[role]["requests"] == {"CPU": want.cpu, "MEMORY": want.mem, "GPU": str(want.gpu)}, (recipe, role)
        assert pods[role]["limits"] == {"MEMORY": want.mem_limit, "GPU": str(want.gpu)}, (recipe, role)
        # no cluster.accelerator in the recipes: the kind fixed at registration (UNIRL_ACCELERATOR)
        assert pods[role]["accelerator"] == (DEFAULT_ACCELERATOR.to_flyte_idl().device if want.gpu else None), role
    # the 8 rollout shards are a map task inside the chunk: each shard pod gets the rollout resources
    assert any(n.array_node is not None for n in spec.nodes)
    if recipe == "qwen3-math":  # text rewards: a CPU reward pod
        assert pods["reward"]["requests"]["GPU"] == "0"


def test_overrides_and_defaults_per_shape():
    spec = _compile(["loop.total_steps=1", "cluster.accelerator=h100", "cluster.train.mem=200Gi",
                     "cluster.train.mem_limit=240Gi", "cluster.reward.gpu=0"], recipe="sd35m-pickscore")
    pods = {role: _named(p) for role, p in _pods(spec).items()}
    assert pods["train"]["requests"]["MEMORY"] == "200Gi" and pods["train"]["accelerator"] == "nvidia-h100"
    assert pods["reward"]["requests"]["GPU"] == "0" and pods["reward"]["accelerator"] is None
    # a real model without a cluster section: the GPU shape (1 GPU, 8 CPUs, 64Gi / 96Gi); a 2x8 topology's train pods
    # ask for train_nproc_per_node GPUs
    spec = _compile(["loop.total_steps=1", "diffusion.model.source=org/some-model", "cluster.train_nnodes=2",
                     "cluster.train_nproc_per_node=8"], recipe="tiny-flow-grpo")
    elastic = next(n for n in spec.nodes if n.task_node and "train_elastic_2x8" in n.task_node.reference_id.name)
    req = _named({"requests": {r.name: r.value for r in elastic.task_node.overrides.resources.requests},
                  "limits": {}, "accelerator": None})["requests"]
    assert req == {"CPU": "8", "MEMORY": "64Gi", "GPU": "8"}


def test_bad_resources_name_the_field():
    for over, field in ((["cluster.rollout.gpu=-1"], "cluster.rollout.gpu"),
                        (["cluster.train.mem=lots"], "cluster.train.mem"),
                        (["cluster.accelerator=a100"], "cluster.accelerator")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_run_config("tiny-grpo", over)
    cfg, cluster = load_run_config("tiny-grpo", ["cluster.train.mem=200Gi"])  # the tiny shape's limit: 16Gi
    with pytest.raises(ConfigError, match=r"cluster\.train\.mem_limit='16Gi': expected at least the memory request "
                                          r"\(200Gi\)"):
        resources.check_all(cfg, cluster)  # the setup task's check, before any pod starts


def test_run_local_s_loader_leaves_the_cluster_section_out():
    cfg = load_recipe("sd35m-pickscore", [])  # the recipe has a cluster: section; the RunConfig has no such field
    assert cfg.name == "sd35m-pickscore"
