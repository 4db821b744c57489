"""The setup task preflights the run: a cluster recipe run locally with its placeholder bucket fails there,
naming checkpoint.root and the local-run fix, before any rollout/train task starts."""

from __future__ import annotations

import os

import pytest

from tasks.setup import setup_task


def test_placeholder_bucket_fails_in_setup_naming_checkpoint_root(monkeypatch):
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    with pytest.raises(Exception) as e:
        setup_task(recipe="sd35m-pickscore", overrides=[])
    msg = str(e.value)
    assert "checkpoint.root='s3://my-bucket/unirl/checkpoints'" in msg
    assert "checkpoint.root=runs" in msg and "NoCredentialsError" in msg


def test_tiny_recipe_passes_setup(tmp_path, run_name):
    out = setup_task(recipe="tiny-grpo", overrides=[f"checkpoint.root={tmp_path}", f"name={run_name}"])
    assert out.cfg.name == run_name


def test_setup_writes_the_kuberay_spec_and_stops_without_an_address(tmp_path, run_name):
    """pool.kuberay without pool.address: the setup task writes the validated RayCluster next to the run and
    fails naming pool.address with the kubectl command and the address to attach with."""
    pool = ["pool.execution=pool", "pool.kuberay.image=ghcr.io/example/unirl-train:1", "pool.kuberay.worker_cpus=4"]
    with pytest.raises(Exception, match=r"pool.address=None: .*kubectl apply -f .*raycluster.yaml"):
        setup_task(recipe="tiny-grpo", overrides=[f"checkpoint.root={tmp_path}", f"name={run_name}", *pool])
    assert (tmp_path / run_name / "pool" / "raycluster.yaml").read_text().startswith("apiVersion: ray.io/v1")
    with pytest.raises(Exception, match=r"pool.kuberay.worker_cpus=0.5: expected room"):
        setup_task(recipe="tiny-grpo", overrides=[f"checkpoint.root={tmp_path}", f"name={run_name}", *pool,
                                                  "pool.kuberay.worker_cpus=0.5", "pool.address=ray://h:10001"])


def test_workflow_refuses_rollout_with_trainer_in_setup(tmp_path, run_name):
    """loop.rollout_with_trainer is run_local's (one process is rollout and trainer): the workflow, whose phases are
    separate tasks, stops at setup naming the field and the fix."""
    with pytest.raises(Exception, match=r"loop.rollout_with_trainer=True: expected unset or false in a Flyte workflow.*"
                                        r"pool.placement='shared'"):
        setup_task(recipe="tiny-grpo", overrides=[f"checkpoint.root={tmp_path}", f"name={run_name}",
                                                  "loop.rollout_with_trainer=true"])


def test_pods_workflow_writes_the_full_state_every_step(tmp_path, run_name):
    """Every pods train task restores the previous version's full state: a recipe's checkpoint.every_n_steps > 1
    (what run_local and the pool honour) becomes 1 in a pods workflow's setup, which every task then runs with."""
    out = setup_task(recipe="tiny-grpo", overrides=[f"checkpoint.root={tmp_path}", f"name={run_name}",
                                                    "checkpoint.every_n_steps=2"])
    assert out.cfg.checkpoint.every_n_steps == 1
    pool = setup_task(recipe="tiny-grpo", overrides=[f"checkpoint.root={tmp_path}", f"name={run_name}-pool",
                                                     "checkpoint.every_n_steps=2", "pool.execution=pool"])
    assert pool.cfg.checkpoint.every_n_steps == 2
