"""The KubeRay RayCluster spec generated from pool.kuberay: its shape, its validation against the placement the
pool will ask for, and the setup step that writes it (no Kubernetes here: the spec is checked as data)."""

from __future__ import annotations

import copy

import pytest
import yaml

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.pool.kuberay import (
    client_address,
    pool_bundles,
    raycluster_spec,
    setup_pool,
    validate_raycluster,
)

IMAGE = "ghcr.io/example/unirl-train:1"
GPU_POOL = ["pool.execution=pool", f"pool.kuberay.image={IMAGE}", "pool.engine.num_gpus=1", "pool.trainer.num_gpus=1"]


def _cfg(*extra: str, root: str = "runs"):
    return load_recipe("tiny-grpo", [*GPU_POOL, f"checkpoint.root={root}", *extra])


def test_spec_has_head_and_gpu_workers_and_round_trips_through_yaml():
    cfg = _cfg("pool.kuberay.worker_gpus=2", "pool.kuberay.worker_cpus=16", "pool.kuberay.namespace=rl",
               'pool.kuberay.node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"}')
    spec = raycluster_spec(cfg)
    validate_raycluster(spec, cfg)
    assert spec["apiVersion"] == "ray.io/v1" and spec["kind"] == "RayCluster"
    assert spec["metadata"] == {"name": "tiny-grpo-pool", "namespace": "rl",
                                "labels": {"app.kubernetes.io/part-of": "unirl", "unirl/run": "tiny-grpo-pool"}}
    assert spec["spec"]["rayVersion"] == "2.60.0"
    head = spec["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no actors on the head
    worker = spec["spec"]["workerGroupSpecs"][0]
    c = worker["template"]["spec"]["containers"][0]
    assert c["image"] == IMAGE
    assert c["resources"]["requests"] == {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "2"}
    assert c["resources"]["limits"] == c["resources"]["requests"]
    assert worker["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert yaml.safe_load(yaml.safe_dump(spec)) == spec
    assert client_address(cfg) == "ray://tiny-grpo-pool-head-svc.rl.svc.cluster.local:10001"


def test_bundles_follow_the_placement():
    colocate = _cfg().pool
    assert pool_bundles(colocate) == [{"CPU": 2.0, "GPU": 2.0}]
    separate = _cfg("pool.placement=separate").pool
    assert pool_bundles(separate) == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]  # reward needs none
    ranks = _cfg("pool.placement=separate", "pool.trainer_ranks=2").pool  # a bundle per trainer rank
    assert pool_bundles(ranks) == [{"CPU": 1.0, "GPU": 1.0}] * 3
    assert pool_bundles(_cfg("pool.trainer_ranks=2").pool) == [{"CPU": 3.0, "GPU": 3.0}]
    shared = _cfg("pool.placement=shared").pool  # one process on the trainer's GPU: the engine's ask is not used
    assert pool_bundles(shared) == [{"CPU": 1.0, "GPU": 1.0}]


@pytest.mark.parametrize("extra, field", [
    (["pool.kuberay.worker_gpus=0"], "pool.kuberay.worker_gpus=0: expected room for the pool's placement"),
    # colocate puts 2 GPUs in one bundle: two 1-GPU pods cannot hold it, separate bundles can
    (["pool.kuberay.worker_gpus=1", "pool.kuberay.worker_replicas=2"], "pool.kuberay.worker_gpus=1"),
    (["pool.kuberay.worker_gpus=2", "pool.kuberay.worker_cpus=1"], "pool.kuberay.worker_cpus=1"),
    (["pool.kuberay.worker_gpus=2", "pool.kuberay.worker_memory=lots"], r"requests.memory='lots'"),
    (["pool.kuberay.worker_gpus=2", "pool.kuberay.name=My_Pool"], "pool.kuberay.name='My_Pool'"),
])
def test_bad_resources_name_the_field(extra, field):
    cfg = _cfg(*extra)
    with pytest.raises(ConfigError, match=field):
        validate_raycluster(raycluster_spec(cfg), cfg)


def test_separate_placement_fits_one_gpu_per_pod():
    cfg = _cfg("pool.placement=separate", "pool.kuberay.worker_gpus=1", "pool.kuberay.worker_replicas=2")
    validate_raycluster(raycluster_spec(cfg), cfg)


@pytest.mark.parametrize("edit, field", [
    (lambda s: s.update(apiVersion="ray.io/v1alpha1"), "apiVersion"),
    (lambda s: s["spec"].update(rayVersion="2.9.0"), "pool.kuberay.ray_version='2.9.0'"),
    (lambda s: s["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(image=""),
     r"workerGroupSpecs\[0\].container.image"),
    (lambda s: s["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
     .update(cpu="32"), r"workerGroupSpecs\[0\].container.resources.limits"),
    (lambda s: s["spec"].update(workerGroupSpecs=[]), "workerGroupSpecs"),
    (lambda s: s["spec"]["workerGroupSpecs"][0].update(replicas=0), "pool.kuberay.worker_replicas=0"),
])
def test_an_edited_spec_is_refused_naming_the_field(edit, field):
    cfg = _cfg("pool.kuberay.worker_gpus=2")
    spec = copy.deepcopy(raycluster_spec(cfg))
    edit(spec)
    with pytest.raises(ConfigError, match=field):
        validate_raycluster(spec, cfg)


def test_image_is_required():
    with pytest.raises(ConfigError, match="pool.kuberay.image"):
        load_recipe("tiny-grpo", ["pool.execution=pool", "pool.kuberay.worker_gpus=1"])


def test_setup_writes_the_spec_and_says_how_to_start_and_attach(tmp_path):
    cfg = _cfg("pool.kuberay.worker_gpus=2", root=str(tmp_path))
    with pytest.raises(ConfigError, match=r"pool.address=None: .*kubectl apply -f .*raycluster.yaml.*"
                                          r"pool.address=ray://tiny-grpo-pool-head-svc"):
        setup_pool(cfg)
    written = yaml.safe_load((tmp_path / "tiny-grpo" / "pool" / "raycluster.yaml").read_text())
    assert written == raycluster_spec(cfg)
    attached = _cfg("pool.kuberay.worker_gpus=2", "pool.address=ray://tiny-grpo-pool-head-svc:10001",
                    root=str(tmp_path))
    notes = setup_pool(attached)
    assert len(notes) == 1 and "kubectl apply -f" in notes[0]
    assert setup_pool(load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}"])) == []  # pods: nothing to do
