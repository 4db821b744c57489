"""Deployment modes of a rollout engine, and the weight-sync block that goes with them.

- ``direct``: the trainside engine samples with the training module itself. There is nothing to
  publish to, so a ``sync`` block is a configuration error (it would suggest weights travel).
- ``separate``: a dedicated engine (vLLM / SGLang) on its own resources. It only ever serves
  what was published to it, so a ``sync`` block is required.
- ``colocate``: a dedicated engine sharing accelerators with training. Besides ``sync`` it must
  sleep (release memory) while training runs and wake before the next rollout.

``validate_deployment`` is called once when a run is configured, so a wrong combination fails
before any server starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from unirl_core.errors import ConfigError, check_ints, field_error
from unirl_core.rollout.registry import engine_entry, engine_names

DeploymentMode = Literal["direct", "separate", "colocate"]
SyncMethod = Literal["reload", "lora"]

DEPLOYMENT_MODES: tuple[str, ...] = ("direct", "separate", "colocate")


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """How published weights reach a dedicated engine."""

    method: SyncMethod = "reload"
    """``reload``: full weights reloaded in place from the published folder; ``lora``: an adapter."""
    every_n_steps: int = 1
    """Publish to the engine after every n-th optimizer step (1 = strictly on-policy rollouts)."""
    max_policy_lag: int = 1
    """Largest allowed ``trainer version - served version`` of a rollout before training refuses it."""

    def __post_init__(self) -> None:
        if self.method not in ("reload", "lora"):
            raise field_error(ConfigError, "sync.method", self.method, "'reload' or 'lora'", "pick one")
        check_ints("sync", self, ("every_n_steps",), "use 1 to publish after every step")
        if not (isinstance(self.max_policy_lag, int) and self.max_policy_lag >= self.every_n_steps):
            raise field_error(ConfigError, "sync.max_policy_lag", self.max_policy_lag,
                              f"an integer >= every_n_steps={self.every_n_steps}",
                              "rollouts between two publishes lag by up to every_n_steps versions")


@dataclass(frozen=True, kw_only=True)
class DeploymentConfig:
    """Where the rollout engine runs relative to training."""

    mode: DeploymentMode = "direct"
    """``direct`` (trainside), ``separate`` (dedicated, own resources) or ``colocate`` (dedicated, shared)."""
    engine: str = "trainside"
    """Which engine samples: ``trainside``, or a registered dedicated engine (``vllm``, ``sglang``, or one of your
    own: ``unirl_core.rollout.registry``)."""
    sync: SyncConfig | None = None
    """Weight publication to a dedicated engine; must be None for ``direct`` and set otherwise."""
    sleep_level: int = 1
    """``colocate`` only: memory the engine releases while training (1 = KV cache and weights to host,
    2 = drop weights too, they are reloaded on publish anyway)."""

    def __post_init__(self) -> None:
        validate_deployment(self)


def validate_deployment(cfg: DeploymentConfig) -> None:
    """Raise ``ConfigError`` naming the field for any mode / engine / sync combination that cannot work."""
    if cfg.mode not in DEPLOYMENT_MODES:
        raise field_error(ConfigError, "deployment.mode", cfg.mode, f"one of {DEPLOYMENT_MODES}",
                          "use 'direct' for trainside sampling, 'separate' or 'colocate' for vLLM/SGLang")
    entry = engine_entry(cfg.engine, "deployment.engine")
    if cfg.sync is not None and not isinstance(cfg.sync, SyncConfig):
        raise field_error(ConfigError, "deployment.sync", type(cfg.sync).__name__, "a SyncConfig or None",
                          "build it with SyncConfig(method=...)")
    if cfg.mode == "direct":
        if entry.dedicated:
            raise field_error(ConfigError, "deployment.engine", cfg.engine, "'trainside' with mode='direct'",
                              "a dedicated engine needs mode='separate' or 'colocate' plus a sync block")
        if cfg.sync is not None:
            raise field_error(ConfigError, "deployment.sync", cfg.sync, "None with mode='direct'",
                              "the trainside engine samples with the training weights; remove the sync block")
        return
    if not entry.dedicated:
        raise field_error(ConfigError, "deployment.engine", cfg.engine,
                          f"one of {tuple(engine_names(dedicated=True))} with mode={cfg.mode!r}",
                          "use mode='direct' for trainside sampling")
    if cfg.sync is None:
        raise field_error(ConfigError, "deployment.sync", None, f"a SyncConfig with mode={cfg.mode!r}",
                          "a dedicated engine only serves published weights; add sync=SyncConfig(method='reload')")
    if cfg.mode == "colocate" and cfg.sleep_level not in (1, 2):
        raise field_error(ConfigError, "deployment.sleep_level", cfg.sleep_level, "1 or 2 with mode='colocate'",
                          "use 1 (weights kept in host memory) or 2 (weights dropped, reloaded on publish)")


def needs_sleep(cfg: DeploymentConfig) -> bool:
    """True when the engine must release memory around every train phase."""
    return cfg.mode == "colocate"
