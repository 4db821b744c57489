"""report.mlflow: every step's metrics reach a real MLflow tracking store (a local ``file:`` store, read back with
MlflowClient), one MLflow run across resumed writers; unset fields follow MLFLOW_* variables."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient  # the tracking extra (mlflow-skinny): scripts/install.sh installs it

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local
from unirl_core.report.mlflow_log import RUN_TAG, MlflowConfig


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.7 refuses file: stores without it
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    return (tmp_path / "mlruns").as_uri()


def _runs(uri: str, experiment: str, tag: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {uri}"
    return client, client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{tag}'")


def _history(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


@pytest.mark.slow
def test_run_local_logs_every_step_to_one_mlflow_run_and_a_resume_continues_it(tmp_path, store):
    torch.set_num_threads(1)
    over = [f"checkpoint.root={tmp_path / 'ckpt'}", "report.tensorboard=false",
            f"report.mlflow={{tracking_uri: '{store}', experiment: unirl-test}}"]
    cfg = load_recipe("tiny-grpo", over + ["loop.total_steps=2"])
    history = run_local(cfg, progress=False)
    client, runs = _runs(store, "unirl-test", cfg.name)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    assert _history(client, run_id, "reward/mean") == {1: history[0]["reward/mean"], 2: history[1]["reward/mean"]}
    assert _history(client, run_id, "train/loss")[2] == history[1]["train/loss"]
    assert runs[0].data.params["recipe"] == cfg.name
    more = run_local(load_recipe("tiny-grpo", over + ["loop.total_steps=3"]), progress=False)
    client, runs = _runs(store, "unirl-test", cfg.name)
    assert [r.info.run_id for r in runs] == [run_id]  # the resumed run wrote into the same MLflow run
    assert _history(client, run_id, "reward/mean")[3] == more[-1]["reward/mean"]


def test_report_task_writer_follows_the_environment(tmp_path, store, monkeypatch):
    from tasks.report import write_mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path / 'ckpt'}", "report.mlflow={}"])
    for step in (1, 2):  # two report tasks: two writers, one MLflow run
        write_mlflow(cfg, step, {"reward/mean": 0.1 * step, "step": step, "flag": True})
    client, runs = _runs(store, "from-env", cfg.name)
    assert len(runs) == 1
    assert _history(client, runs[0].info.run_id, "reward/mean") == pytest.approx({1: 0.1, 2: 0.2})
    assert set(runs[0].data.metrics) == {"reward/mean"}  # booleans and the x axis are no metrics


def test_recipe_values_win_over_the_environment():
    env = {"MLFLOW_TRACKING_URI": "http://env:5000", "MLFLOW_EXPERIMENT_NAME": "env-exp"}
    assert MlflowConfig().resolved(env) == {"tracking_uri": "http://env:5000", "experiment": "env-exp"}
    assert MlflowConfig(experiment="mine").resolved(env)["experiment"] == "mine"
    assert MlflowConfig().resolved({}) == {"tracking_uri": None, "experiment": "unirl"}
    with pytest.raises(ConfigError, match=r"report\.mlflow\.experiment"):
        load_recipe("tiny-grpo", ["report.mlflow={experiment: ''}"])


def test_an_unusable_store_names_the_field(tmp_path, monkeypatch):
    from unirl_core.report.mlflow_log import MlflowLog

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match=r"report\.mlflow\.tracking_uri.*MLFLOW_ALLOW_FILE_STORE"):
        MlflowLog(MlflowConfig(tracking_uri=(tmp_path / "m").as_uri()), "run")
