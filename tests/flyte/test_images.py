"""Image choice: ``--image`` (default or per role) beats the role ImageSpecs, in the package and in the
sub-DAG a ``grpo_chunk`` pod compiles; ``is_container`` keeps the guarded imports in any given image."""

from __future__ import annotations

import pytest
from flytekit.configuration import ImageConfig, SerializationSettings
from flytekit.configuration.default_images import DefaultImages
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.image_spec.image_spec import _F_IMG_ID

from images import given_image, reward_image, rollout_image, train_image
from tasks.run_types import ClusterConfig, load_run_config
from unirl_core.checkpoint import CheckpointRef
from workflows.grpo import grpo_chunk


def _cfg(*images: str) -> ImageConfig:
    return ImageConfig.validate_image(None, "image", images)


def test_given_image_rules():
    assert given_image(None, "train") is None
    assert given_image(_cfg(), "train") is None  # flytekit's own default image does not count
    assert _cfg().default_image.full == DefaultImages.default_image()
    assert given_image(_cfg("ghcr.io/x/y:1"), "reward") == "ghcr.io/x/y:1"
    both = _cfg("ghcr.io/x/y:1", "train=ghcr.io/x/t:2")
    assert given_image(both, "train") == "ghcr.io/x/t:2" and given_image(both, "rollout") == "ghcr.io/x/y:1"


def _pod_compile(image_config: ImageConfig):
    cfg, cluster = load_run_config("tiny-grpo", ["loop.total_steps=1"])
    ref = CheckpointRef(uri="s3://b/runs/tiny-grpo/step-00000000", run="tiny-grpo", step=0, policy_version=0)
    settings = SerializationSettings(project="p", domain="d", version="v1", image_config=image_config)
    grpo_chunk._wf = None
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_serialization_settings(settings)) as ctx:
        es = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(es)) as ctx:
            inputs = TypeEngine.dict_to_literal_map(
                ctx, {"cfg": cfg, "cluster": cluster, "session": "s", "ckpt": ref, "max_steps": 0},
                type_hints={"cfg": type(cfg), "cluster": ClusterConfig, "session": str, "ckpt": CheckpointRef,
                            "max_steps": int})
            return grpo_chunk.dispatch_execute(ctx, inputs)


def test_a_pod_compiles_its_sub_dag_with_the_given_images():
    # in a pod the image config arrives with the dynamic task (_F_SS_C), as registered
    spec = _pod_compile(_cfg("ghcr.io/x/y:1", "reward=ghcr.io/x/r:3"))
    images = {t.id.name: t.container.image for t in spec.tasks}
    assert images["tasks.reward.reward_task"] == "ghcr.io/x/r:3"
    assert {v for k, v in images.items() if k != "tasks.reward.reward_task"} == {"ghcr.io/x/y:1"}
    grpo_chunk._wf = None


@pytest.fixture
def pod(monkeypatch):
    ctx = FlyteContextManager.current_context()
    es = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
    with FlyteContextManager.with_context(ctx.with_execution_state(es)):
        yield monkeypatch


def test_is_container_in_pods(pod):
    pod.delenv(_F_IMG_ID, raising=False)
    assert rollout_image.is_container() and train_image.is_container()  # an image given with --image
    pod.setenv(_F_IMG_ID, "some-other-imagespec")
    assert reward_image.is_container()  # a user's own ImageSpec-built image
    pod.setenv(_F_IMG_ID, train_image.id)  # our train image: only train's guarded imports run
    assert train_image.is_container() and not rollout_image.is_container() and not reward_image.is_container()


def test_every_role_image_holds_the_library_dependencies():
    """A role ImageSpec that misses a ``[project]`` dependency fails on the cluster only (e.g. the report's charts
    need matplotlib in every task that draws them): each role holds every one, by name."""
    import re
    import tomllib
    from pathlib import Path

    def name(requirement: str) -> str:
        return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    needed = {name(r) for r in project["dependencies"]}
    for spec in (rollout_image, reward_image, train_image):
        missing = needed - {name(p) for p in spec.packages}
        assert not missing, (spec.name, sorted(missing))


def test_the_report_tasks_image_holds_the_tracking_extra():
    """report.wandb / report.mlflow import their client in the report task (train image): every package of the
    ``tracking`` extra is in it, by name."""
    import re
    import tomllib
    from pathlib import Path

    def name(requirement: str) -> str:
        return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    needed = {name(r) for r in project["optional-dependencies"]["tracking"]}
    assert {"wandb", "mlflow-skinny"} <= needed
    assert not needed - {name(p) for p in train_image.packages}
