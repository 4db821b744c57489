"""The environment contract of agentic rollouts, and the registry environments join by name.

An environment is a small state machine over text: ``reset(task)`` returns the first user message, each
``step(action)`` takes one model turn (decoded, special tokens dropped) and returns what the environment
answers (``observation``), a reward for this step and whether the episode is over. The agentic engine
(``unirl_core.rollout.agentic``) builds one instance per trajectory from the run's config, so instances hold
per-episode state only and never share anything mutable: stepping many trajectories from threads or asyncio
tasks is safe as long as each trajectory has its own instance (``build_env`` gives a fresh one per call).

Bad model output is part of the game, not an error: an environment answers it with an error observation
(``StepResult.error`` set) and the episode goes on. An exception out of ``step`` is a bug or a broken task
(e.g. a missing answer target); the engine ends that trajectory with finish reason ``env_error``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Protocol, runtime_checkable

from unirl_core.errors import ConfigError, field_error
from unirl_core.plugins import discover


@dataclass(frozen=True, kw_only=True)
class EnvTask:
    """What an episode is about: the prompt record of the Part it fills."""

    prompt: str
    """The prompt text of the Part (the task statement)."""
    targets: dict[str, str] = field(default_factory=dict)
    """The Part's reference data (e.g. ``{"answer": "1776"}``)."""
    group_id: str = ""
    """The Part's group id: siblings share it, so hidden state drawn from it is the same for a whole group."""


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """The environment's answer to one model turn."""

    observation: str
    """Text shown to the model before its next turn (ignored when ``done``)."""
    reward: float = 0.0
    """Reward of this step; the trajectory's reward combines them (``AgentConfig.shaping_weight``)."""
    done: bool = False
    """The episode is over (goal reached or a final answer given)."""
    error: str | None = None
    """Why the model's turn was rejected (malformed tool call, sandbox limit); the episode goes on."""


@runtime_checkable
class Environment(Protocol):
    """One episode's state; see the module docstring."""

    def reset(self, task: EnvTask) -> str:
        """Start an episode; returns the first user message (usually the task text, maybe with instructions)."""
        ...

    def step(self, action: str) -> StepResult:
        """Answer one model turn."""
        ...


@dataclass(frozen=True)
class EnvEntry:
    name: str
    config: type
    build: Callable[[Any], Environment]


_ENTRIES: dict[str, EnvEntry] = {}


def register_env(name: str, *, config: type, build: Callable[[Any], Environment], replace: bool = False) -> None:
    """Register an environment: ``config`` is a frozen dataclass whose ``name`` field defaults to ``name``;
    ``build(config)`` returns a fresh ``Environment`` (one per trajectory)."""
    if not (is_dataclass(config) and getattr(config, "name", None) == name):
        raise field_error(ConfigError, f"{getattr(config, '__name__', config)}.name", getattr(config, "name", None),
                          f"a dataclass whose name field defaults to {name!r}",
                          f"declare name: Literal[{name!r}] = field(default={name!r}, init=False)")
    if name in _ENTRIES and not replace and _ENTRIES[name].config is not config:
        raise field_error(ConfigError, "environment name", name, "a name not yet registered",
                          "pick another name or pass replace=True")
    _ENTRIES[name] = EnvEntry(name=name, config=config, build=build)


def env_entry(name: str, path: str = "env") -> EnvEntry:
    """The registered environment ``name`` (the plugins are imported on a miss: ``unirl_core.plugins``)."""
    if name not in _ENTRIES:
        discover()
    entry = _ENTRIES.get(name)
    if entry is None:
        raise field_error(ConfigError, f"{path}.name", name, f"one of {env_names()}",
                          "pick a registered environment or register yours with unirl_core.env.register_env")
    return entry


def env_names() -> list[str]:
    """The registered names, the plugins' included."""
    discover()
    return sorted(_ENTRIES)


def build_env(config: Any) -> Environment:
    """A fresh environment instance for ``config`` (a registered environment's config)."""
    return env_entry(getattr(config, "name", type(config).__name__)).build(config)


@dataclass(frozen=True)
class EnvChoice:
    """``Annotated`` marker of an ``env`` config field: parsed by its ``name`` via the registry (see
    ``unirl_core.config.loader``)."""

    def parse_config(self, value: Any, path: str, convert: Callable[[type, Any, str], Any]) -> Any:
        if is_dataclass(value) and not isinstance(value, type):
            env_entry(getattr(value, "name", type(value).__name__), path)
            return value
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise field_error(ConfigError, path, value, f"a mapping with a name, e.g. {{name: <env>}} "
                              f"(one of {env_names()})", "write the env section as key: value pairs with a name")
        entry = env_entry(value["name"], path)
        own = {f.name for f in fields(entry.config) if f.init}
        for knob in sorted(set(value) - own - {"name"}):
            raise field_error(ConfigError, f"{path}.{knob}", value[knob],
                              f"a field of environment {value['name']!r} ({entry.config.__name__})",
                              f"its fields: {sorted(own)}")
        return convert(entry.config, {k: v for k, v in value.items() if k != "name"}, path)
