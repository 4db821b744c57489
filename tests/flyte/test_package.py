"""`pyflyte --pkgs workflows package` compiles without a docker daemon or a cluster; the protobufs hold
the GPU requests, accelerators, retries, caching, the mapped rollout, the Elastic train tasks and schedules."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from google.protobuf.json_format import MessageToDict

REPO = Path(__file__).resolve().parents[2]


IMAGE = "ghcr.io/example/unirl:dev"


def _package(tmp: Path, images: tuple[str, ...] = (IMAGE,)) -> dict[str, bytes]:
    out = tmp / "pkg.tgz"
    env = {**os.environ, "UNIRL_ACCELERATOR": "h200", "PYTHONPATH": str(REPO)}
    env.pop("UNIRL_IMAGE_REGISTRY", None)
    pyflyte = Path(sys.executable).with_name("pyflyte")
    flags = [a for img in images for a in ("--image", img)]
    proc = subprocess.run([str(pyflyte), "--pkgs", "workflows", "package", *flags,
                           "-f", "-o", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with tarfile.open(out) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".pb")}


pytestmark = pytest.mark.slow  # one pyflyte subprocess, ~20 s on 2 busy cores


def _decode(files: dict[str, bytes]) -> dict[str, dict]:
    """Entity name -> decoded spec. Files end in _1 (task), _2 (workflow) or _3 (launch plan)."""
    out: dict[str, dict] = {}
    for name, data in files.items():
        kind = name.rsplit("_", 1)[1].removesuffix(".pb")
        msg = {"1": task_pb2.TaskSpec, "2": workflow_pb2.WorkflowSpec, "3": launch_plan_pb2.LaunchPlan}[kind]()
        msg.ParseFromString(data)
        key = name.split("_", 1)[1].rsplit("_", 1)[0] + f"#{kind}"
        out[key] = MessageToDict(msg)
    return out


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> dict[str, dict]:
    """Packaged with ``--image ghcr.io/example/unirl:dev``."""
    return _decode(_package(tmp_path_factory.mktemp("pkg")))


def _task(package, name):
    return package[f"{name}#1"]["template"]


def _gpus(template) -> str | None:
    return next((r["value"] for r in template["container"]["resources"]["requests"] if r["name"] == "GPU"), None)


def test_gpu_tasks_request_gpus_and_the_accelerator(package):
    for name, gpus in [("tasks.rollout.rollout_task", "1"), ("tasks.rollout.rollout_one_task", "1"),
                       ("tasks.reward.reward_task", "1"),
                       ("tasks.train.train_task", "1"), ("tasks.train.train_elastic_1x8", "8"),
                       ("tasks.train.train_elastic_2x8", "8")]:
        t = _task(package, name)
        assert _gpus(t) == gpus, name
        assert t["extendedResources"]["gpuAccelerator"]["device"] == "nvidia-h200", name
    assert _gpus(_task(package, "tasks.advantage.advantage_task")) is None


def test_retries_timeouts_cache_and_images(package):
    for name in ("tasks.rollout.rollout_task", "tasks.rollout.rollout_one_task"):
        roll = _task(package, name)
        assert roll["metadata"]["retries"]["retries"] == 2 and roll["metadata"]["timeout"] == "7200s", name
        assert roll["metadata"]["discoverable"] and roll["metadata"]["discoveryVersion"], name
    reward = _task(package, "tasks.reward.reward_task")
    assert reward["metadata"]["retries"]["retries"] == 3
    # side-effecting tasks are never cached
    for name in ("tasks.train.train_task", "tasks.publish.publish_task"):
        assert not _task(package, name)["metadata"].get("discoverable"), name


def test_elastic_train_tasks(package):
    multi = _task(package, "tasks.train.train_elastic_2x8")
    assert multi["type"] == "pytorch"
    assert multi["custom"]["elasticConfig"]["nprocPerNode"] == 8
    assert multi["custom"]["elasticConfig"]["minReplicas"] == multi["custom"]["elasticConfig"]["maxReplicas"] == 2
    assert _task(package, "tasks.train.train_elastic_4x8")["custom"]["workerReplicas"]["replicas"] == 4
    # one node: torch elastic runs inside one pod, no training operator needed
    assert _task(package, "tasks.train.train_elastic_1x8")["type"] == "python-task"


def test_rollout_tasks_and_the_dynamic_chunk_are_packaged(package):
    """``loop.rollout_shards`` > 1 maps ``rollout_task`` inside the chunk (with the recipe's resources,
    ``tests/flyte/test_resources.py``); one shard wires ``rollout_one_task``. Both tasks are packaged."""
    assert "tasks.rollout.rollout_one_task#1" in package and "tasks.rollout.rollout_task#1" in package
    assert "tasks.rollout.join_shards_task#1" in package
    assert package["workflows.grpo.grpo_chunk#1"]["template"]["metadata"]["runtime"]  # the @dynamic chunk


def test_launch_plans_schedule_and_resume_latest(package):
    lps = {k.split("#")[0]: v for k, v in package.items() if k.endswith("#3")}
    assert lps["nightly_sd35m_pickscore"]["spec"]["entityMetadata"]["schedule"]["cronSchedule"]["schedule"] == \
        "0 2 * * *"
    assert lps["qwen3_math_every_6h"]["spec"]["entityMetadata"]["schedule"]["rate"] == {"value": 6, "unit": "HOUR"}
    fixed = lps["nightly_sd35m_pickscore"]["spec"]["fixedInputs"]["literals"]
    assert fixed["resume"]["scalar"]["primitive"]["stringValue"] == "latest"


def _images(package) -> dict[str, str]:
    return {k.split("#")[0]: v["template"]["container"]["image"] for k, v in package.items() if k.endswith("#1")}


def test_the_image_given_with_dash_dash_image_runs_every_task(package):
    images = _images(package)
    assert len(images) >= 15 and "tasks.train.train_elastic_2x8" in images  # incl. the PyTorchJob and the map task
    assert set(images.values()) == {IMAGE}, images


def test_a_named_role_image_overrides_its_role_and_the_image_specs_stay_the_default(tmp_path):
    images = _images(_decode(_package(tmp_path, ("rollout=ghcr.io/example/rollout:7",))))
    rollout = {k for k in images if k.startswith("tasks.rollout.rollout_")}
    assert len(rollout) == 2
    assert {images[k] for k in rollout} == {"ghcr.io/example/rollout:7"}
    # no default --image: the other roles keep their ImageSpec (built by flytekit when missing)
    assert images["tasks.reward.reward_task"].startswith("unirl-reward:")
    assert images["tasks.train.train_task"].startswith("unirl-train:")
    assert images["workflows.grpo.grpo_chunk"].startswith("unirl-train:")


def test_the_sweep_and_the_shared_pool_launch_plan_are_packaged(package):
    """``workflows/sweep.py`` (its @dynamic of ``grpo`` subworkflows) and the LaunchPlan that attaches the nightly
    LoRA run to the named pool compile with the rest."""
    assert "workflows.sweep.sweep#2" in package and "workflows.sweep.sweep_runs#1" in package
    lps = {k.split("#")[0]: v for k, v in package.items() if k.endswith("#3")}
    lp = lps["nightly_sd35m_pickscore_shared_pool"]["spec"]
    overrides = [lit["scalar"]["primitive"]["stringValue"]
                 for lit in lp["defaultInputs"]["parameters"]["overrides"]["default"]["collection"]["literals"]]
    assert "pool.name=sd35m-lora" in overrides
