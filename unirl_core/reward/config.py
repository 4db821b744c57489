"""Configuration of the reward phase: weighted components, backend, failure policy."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from unirl_core.errors import ConfigError, field_error

RewardBackend = Literal["local", "remote"]
FailurePolicy = Literal["fail", "mark_invalid"]


@dataclass(frozen=True, kw_only=True)
class RewardComponent:
    """One scorer and its weight in the total reward."""

    name: str
    """Registry name of the scorer (``unirl_core.reward.scorer_names()``); also the key in ``Part.rewards``."""
    weight: float = 1.0
    """Multiplier of this component in ``Part.reward`` (the per-component value is stored unweighted)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments of the scorer (model path, target key, ...); must be JSON-serialisable."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise field_error(ConfigError, "reward.components[].name", self.name, "a registered scorer name",
                              "see unirl_core.reward.scorer_names()")
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight)):
            raise field_error(ConfigError, f"reward.components[{self.name}].weight", self.weight, "a finite number",
                              "use e.g. 1.0")
        try:
            json.dumps(self.kwargs)
        except (TypeError, ValueError) as e:
            raise field_error(ConfigError, f"reward.components[{self.name}].kwargs", self.kwargs,
                              "JSON-serialisable values", f"pass paths and numbers only ({e})") from e


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """How a batch is scored."""

    components: tuple[RewardComponent, ...]
    """Weighted scorers; ``(name, weight, kwargs)`` tuples are accepted and converted."""
    backend: RewardBackend = "local"
    """``local`` runs scorers in this process; ``remote`` sends batches to a reward server."""
    failure_policy: FailurePolicy = "fail"
    """A scorer that raises or returns NaN/inf: ``fail`` raises RewardError for the batch;
    ``mark_invalid`` sets ``valid=False`` and ``reward=None`` on that sample (excluded from advantages)."""
    batch_size: int = 32
    """Items per scorer call (and per HTTP request with the remote backend)."""
    remote_url: str | None = None
    """Base URL of the reward server, e.g. ``http://10.0.0.5:8431``; required with ``backend='remote'``."""
    remote_token_env: str = "UNIRL_REWARD_TOKEN"
    """Name of the environment variable that holds the bearer token. The token itself never lives in
    the config, because the config is saved with every checkpoint."""
    remote_timeout_s: float = 120.0
    """Per-request timeout of the client (connect + send + score + receive)."""
    remote_retries: int = 3
    """Retries after a connection error, timeout or 502/503/504 (not after 4xx)."""
    remote_backoff_s: float = 0.5
    """First retry delay; doubles after every retry."""
    remote_max_in_flight: int = 2
    """Requests the client keeps open at once (chunks of ``batch_size``); 2 overlaps transfer with scoring."""

    def __post_init__(self) -> None:
        comps = tuple(c if isinstance(c, RewardComponent) else RewardComponent(name=c[0], weight=c[1],
                      kwargs=dict(c[2]) if len(c) > 2 else {}) for c in self.components)
        object.__setattr__(self, "components", comps)
        if not comps:
            raise field_error(ConfigError, "reward.components", self.components, "at least one component",
                              "e.g. components=[('jpeg_compressibility', 1.0, {})]")
        names = [c.name for c in comps]
        if len(set(names)) != len(names):
            raise field_error(ConfigError, "reward.components", names, "distinct names",
                              "each component is stored under its name in Part.rewards")
        if self.backend not in ("local", "remote"):
            raise field_error(ConfigError, "reward.backend", self.backend, "'local' or 'remote'", "pick a backend")
        if self.failure_policy not in ("fail", "mark_invalid"):
            raise field_error(ConfigError, "reward.failure_policy", self.failure_policy, "'fail' or 'mark_invalid'",
                              "use 'fail' unless occasional bad samples are expected")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise field_error(ConfigError, "reward.batch_size", self.batch_size, "an integer >= 1", "use e.g. 32")
        if self.backend == "remote" and not (self.remote_url or "").startswith(("http://", "https://")):
            raise field_error(ConfigError, "reward.remote_url", self.remote_url, "an http(s):// URL",
                              "start `python -m unirl_core.reward.server` and point remote_url at it")
        if not (self.remote_timeout_s > 0 and self.remote_backoff_s >= 0):
            raise field_error(ConfigError, "reward.remote_timeout_s/backoff_s",
                              (self.remote_timeout_s, self.remote_backoff_s), "timeout > 0 and backoff >= 0",
                              "use e.g. 120 and 0.5")
        if not (isinstance(self.remote_max_in_flight, int) and self.remote_max_in_flight >= 1):
            raise field_error(ConfigError, "reward.remote_max_in_flight", self.remote_max_in_flight,
                              "an integer >= 1", "use 2, or 1 to send chunks one after another")
        if not (isinstance(self.remote_retries, int) and self.remote_retries >= 0):
            raise field_error(ConfigError, "reward.remote_retries", self.remote_retries, "an integer >= 0",
                              "use e.g. 3")
