"""Every step's metrics to MLflow, when a recipe asks for it (``report.mlflow``).

One MLflow run per training run, found by its tag ``unirl.run`` (the run name, or ``report.mlflow.run_id``) in the
experiment: ``run_local`` opens it once; each Flyte report task finds the same run again, logs its step and marks it
finished, so every step of every execution (and of a resumed run) lands in one MLflow run. Talks to the tracking
store through ``mlflow.MlflowClient`` (no fluent ``mlflow.start_run``: that keeps the active run in a module global
of the process).

Unset fields follow MLflow's environment: ``MLFLOW_TRACKING_URI`` (a server ``http(s)://...``, ``databricks``, or a
local ``file:`` folder; the ``file:`` store needs ``MLFLOW_ALLOW_FILE_STORE=true`` since MLflow 3.7) and
``MLFLOW_EXPERIMENT_NAME``. Credentials too (``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD``).

mlflow is an optional dependency (the ``tracking`` extra installs ``mlflow-skinny``, the client without the server
and its SQL stack); a run without ``report.mlflow`` never imports it.
"""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Self

from unirl_core.errors import ConfigError, field_error

RUN_TAG = "unirl.run"
DEFAULT_EXPERIMENT = "unirl"
SKIPPED = ("step",)
BATCH = 1000  # MLflow's limit of metrics per log_batch call


@dataclass(frozen=True, kw_only=True)
class MlflowConfig:
    """``report.mlflow``: where the run's metrics go in MLflow. Unset fields follow MLflow's environment variables;
    a value set in the recipe wins."""

    tracking_uri: str | None = None
    """Tracking server or store; None: ``MLFLOW_TRACKING_URI``, else MLflow's default."""
    experiment: str | None = None
    """Experiment name (created when missing); None: ``MLFLOW_EXPERIMENT_NAME``, else ``unirl``."""
    run_id: str | None = None
    """The ``unirl.run`` tag that identifies the run across writers; None: the run name."""

    def __post_init__(self) -> None:
        for name in ("tracking_uri", "experiment", "run_id"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise field_error(ConfigError, f"report.mlflow.{name}", v, "a non-empty string or unset",
                                  "leave it unset to follow the MLflow environment variables")

    def resolved(self, env: Mapping[str, str] | None = None) -> dict[str, str | None]:
        """tracking_uri and experiment as this process opens the run (recipe, else environment, else default)."""
        env = os.environ if env is None else env
        return {"tracking_uri": self.tracking_uri or env.get("MLFLOW_TRACKING_URI") or None,
                "experiment": self.experiment or env.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT}


def _import_mlflow():
    try:
        import mlflow
    except ImportError as e:
        raise field_error(ConfigError, "report.mlflow", "set", "the mlflow package installed",
                          "pip install 'unirl-flyte[tracking]' (mlflow-skinny), or remove report.mlflow") from e
    return mlflow


class MlflowLog:
    """The MLflow run of ``run_name`` (found by tag, or created); ``log(step, metrics)``; ``close()`` ends it."""

    def __init__(self, cfg: MlflowConfig, run_name: str, *, run_config: Mapping[str, object] | None = None,
                 execution: str | None = None) -> None:
        mlflow = _import_mlflow()
        settings = cfg.resolved()
        tag = cfg.run_id or run_name
        try:
            self.client = mlflow.MlflowClient(tracking_uri=settings["tracking_uri"])
            experiment = self.client.get_experiment_by_name(settings["experiment"])
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(settings["experiment"]))
            found = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{tag}'",
                                            max_results=1, order_by=["attributes.start_time ASC"])
        except mlflow.exceptions.MlflowException as e:
            fix = (f"export MLFLOW_ALLOW_FILE_STORE=true (MLflow >= 3.7 refuses a file: store without it), or point "
                   "it at a tracking server" if "MLFLOW_ALLOW_FILE_STORE" in str(e) else f"MLflow said: {str(e)[:300]}")
            raise field_error(ConfigError, "report.mlflow.tracking_uri", settings["tracking_uri"],
                              "a tracking store this process can use", fix) from e
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {RUN_TAG: tag, **({"flyte.execution": execution} if execution else {})}
            url = os.environ.get("FLYTE_EXECUTION_URL")
            if url:
                tags["mlflow.note.content"] = f"Flyte execution: {url}"
            run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
            params = {k: str(v)[:500] for k, v in (run_config or {}).items()}
            if params:
                self.client.log_batch(self.run_id, params=[mlflow.entities.Param(k, v) for k, v in params.items()])
        self.experiment_id = experiment_id
        self._metric = mlflow.entities.Metric

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        """Every numeric metric of ``step`` at MLflow step ``step``."""
        now = int(time.time() * 1000)
        items = [self._metric(k, float(v), now, int(step)) for k, v in metrics.items()
                 if k not in SKIPPED and not isinstance(v, bool) and isinstance(v, numbers.Real)]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
