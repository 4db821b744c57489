"""Every step's metrics to Weights & Biases, when a recipe asks for it (``report.wandb``).

One W&B run per training run: ``run_local`` opens it once; each Flyte report task resumes the same run id
(``wandb.init(id=..., resume="allow")``), logs its step and finishes, so the steps of one execution form one
W&B run whichever pod wrote them. The run id is ``report.wandb.run_id`` or, by default, the run name
(``RunConfig.name``; a resumed run continues its W&B run, a ``fork_as`` fork gets its own). The Flyte
execution is linked both ways: the report task puts the execution URL (``FLYTE_EXECUTION_URL``, set by
Flyte in task pods) into the run's notes and the execution name into ``config.flyte_execution``, and logs the
W&B run URL in its progress log. Unset fields follow the environment (``WANDB_PROJECT``, ``WANDB_MODE``, ...):
``WANDB_MODE=offline`` runs a recipe without an API key unless the recipe itself says ``mode: online``.
``mode: offline`` writes the run under ``dir`` (one ``writer-*`` folder per writer) for
``wandb sync <dir>/writer-*/wandb/offline-run-*`` later (no network, no account);
``online`` needs ``WANDB_API_KEY`` in the environment (a pod's: ``pyflyte run --envvars WANDB_API_KEY=...`` or
a Kubernetes secret mounted as that variable). A run without ``report.wandb`` never imports wandb.

wandb is an optional dependency (the ``tracking`` extra); ``flytekitplugins-wandb``'s ``@wandb_init`` is not
used because it fixes project, entity and run id when the task is defined (and names a run per pod), while
the recipe decides them at run time here.
"""

from __future__ import annotations

import numbers
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Self

from unirl_core.errors import ConfigError, field_error

WandbMode = Literal["online", "offline"]
SKIPPED = ("step",)


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """``report.wandb``: where the run's metrics go in W&B. A field left unset follows W&B's environment variable
    (``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_MODE``, ``WANDB_RUN_GROUP``, ``WANDB_DIR``; wandb's own default
    when that is unset too); a value set in the recipe wins over the environment."""

    project: str | None = None
    """W&B project; None: ``WANDB_PROJECT`` (one of the two is required when the run opens W&B)."""
    entity: str | None = None
    """Team or user; None: ``WANDB_ENTITY``, else the API key's default entity."""
    mode: WandbMode | None = None
    """``online`` (needs ``WANDB_API_KEY``) or ``offline`` (files under ``dir``; ``wandb sync`` uploads later);
    None: ``WANDB_MODE``, else online. A cluster recipe leaves it unset, so ``WANDB_MODE=offline`` in the pods'
    environment runs it without an API key."""
    run_id: str | None = None
    """W&B run id; None: the run name. Letters, digits, ``-``, ``_``, ``.`` only (W&B's rule)."""
    group: str | None = None
    """W&B group (e.g. a sweep); None: ``WANDB_RUN_GROUP``, else none."""
    dir: str | None = None
    """Local folder for W&B's files; None: ``WANDB_DIR``, else wandb's default (``./wandb``)."""

    def __post_init__(self) -> None:
        if self.project is not None and (not isinstance(self.project, str) or not self.project.strip()):
            raise field_error(ConfigError, "report.wandb.project", self.project, "a W&B project name",
                              "set report.wandb.project (or WANDB_PROJECT), or remove report.wandb to log nowhere")
        if self.mode is not None and self.mode not in ("online", "offline"):
            raise field_error(ConfigError, "report.wandb.mode", self.mode, "'online' or 'offline'",
                              "use offline to write files for `wandb sync` without network (or leave it unset: "
                              "WANDB_MODE decides)")
        if self.run_id is not None and not _valid_id(self.run_id):
            raise field_error(ConfigError, "report.wandb.run_id", self.run_id,
                              "letters, digits, '-', '_' or '.'", "e.g. my-run-1, or leave it unset")

    def resolved(self, env: Mapping[str, str] | None = None) -> dict[str, str | None]:
        """project, entity, mode, group and dir as this process opens the run: the recipe's value, else the
        environment's (``env``, default ``os.environ``). Raises naming ``report.wandb.project`` without either."""
        env = os.environ if env is None else env
        out = {name: getattr(self, name) if getattr(self, name) is not None else env.get(var) or None
               for name, var in ENVIRONMENT.items()}
        if out["project"] is None:
            raise field_error(ConfigError, "report.wandb.project", None, "a W&B project name (the recipe's, or "
                              "WANDB_PROJECT in the environment)", "set report.wandb.project or export "
                              "WANDB_PROJECT=<project>, or remove report.wandb to log nowhere")
        out["mode"] = out["mode"] or "online"
        return out


ENVIRONMENT = {"project": "WANDB_PROJECT", "entity": "WANDB_ENTITY", "mode": "WANDB_MODE", "group": "WANDB_RUN_GROUP",
               "dir": "WANDB_DIR"}
"""The W&B variable each unset ``WandbConfig`` field follows."""


def _valid_id(s: str) -> bool:
    return bool(s) and all(c.isalnum() or c in "-_." for c in s)


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise field_error(ConfigError, "report.wandb", "set", "the wandb package installed",
                          "pip install 'unirl-flyte[tracking]' (or remove report.wandb)") from e
    return wandb


class WandbLog:
    """A W&B run opened (or resumed) for ``run_name``; ``log(step, metrics)``; ``close()`` finishes it."""

    def __init__(self, cfg: WandbConfig, run_name: str, *, run_config: Mapping[str, object] | None = None,
                 execution: str | None = None) -> None:
        wandb = _import_wandb()
        run_id = cfg.run_id or "".join(c if c.isalnum() or c in "-_." else "-" for c in run_name)
        url = os.environ.get("FLYTE_EXECUTION_URL")
        notes = f"Flyte execution: {url}" if url else None
        config = dict(run_config or {})
        if execution:
            config["flyte_execution"] = execution
        settings = cfg.resolved()
        folder = settings["dir"]
        if settings["mode"] in ("offline", "dryrun"):
            # wandb names an offline run's folder by the second it started and the run id, so two writers of one
            # run within a second (local Flyte report tasks) would share - and clobber - one file: each writer
            # gets its own folder; `wandb sync <dir>/writer-*/wandb/offline-run-*` uploads them all as one run.
            folder = os.path.join(settings["dir"] or ".", f"writer-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
        if folder:
            os.makedirs(folder, exist_ok=True)
        self.run = wandb.init(project=settings["project"], entity=settings["entity"], id=run_id, name=run_name,
                              group=settings["group"], mode=settings["mode"], dir=folder, resume="allow", notes=notes, config=config,
                              settings=wandb.Settings(silent=True, console="off", save_code=False))
        self.run_id, self.mode = run_id, settings["mode"]

    @property
    def url(self) -> str | None:
        """The run's page (None offline)."""
        return getattr(self.run, "url", None)

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        """Every numeric metric of ``step`` at W&B step ``step`` (steps must not go backwards in one run)."""
        values = {k: float(v) for k, v in metrics.items()
                  if k not in SKIPPED and not isinstance(v, bool) and isinstance(v, numbers.Real)}
        self.run.log(values, step=int(step))

    def close(self) -> None:
        self.run.finish()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MetricSinks:
    """The per-step metric sinks a run writes to (TensorBoard scalars and/or W&B), as one ``log``/``close``."""

    def __init__(self, *sinks) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log(self, step: int, metrics: Mapping[str, object]) -> None:
        for s in self.sinks:
            s.log(step, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
