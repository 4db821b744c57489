"""Rollout engines by name: ``lm.deployment.engine`` picks one.

``trainside`` (the AR engine over the trainer's own model, configured by ``lm.engine``) is built in. A dedicated
engine - one that serves only what the trainer publishes to it - registers itself when its package is imported:
``register_engine(name, config=..., build=...)``. The packages of ``unirl_core.rollout`` (``vllm``, ``sglang``) are
imported on the first lookup, so adding an engine is one folder plus its registration, and no edit elsewhere.

Where a dedicated engine's settings live: ``lm.vllm`` / ``lm.sglang`` for the two built in, ``lm.dedicated_engine``
(a mapping of the engine's config fields) for any other registered one.

What the loop asks of a dedicated engine (``runtime.build.start_engine``, ``runtime.steps``):
- its config: a frozen dataclass with ``model``, ``tokenizer`` (None in a training run: the trainer's encodes),
  ``weight_sync`` (``reload`` | ``lora``), ``lora_alpha``, ``max_lora_rank`` and ``staging_dir``;
- ``build(config, *, policy_version, tokenizer)``: the started engine, with ``generate(request) -> SampleBatch``
  (every Part's log-probs filled, checked against the trainer's replay), ``update_weights(source, version) ->
  seconds`` (``source``: the published ``CheckpointRef``, or a LoRA adapter folder), ``policy_version``,
  ``sleep(level)`` / ``wake_up()`` (colocate) and ``close()``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from typing import Any

from unirl_core.errors import ConfigError, field_error

TRAINSIDE = "trainside"
BUILT_IN_SECTIONS = ("vllm", "sglang")
"""Dedicated engines whose settings have a section of their own, ``lm.<name>``; others use ``lm.dedicated_engine``."""


@dataclass(frozen=True)
class EngineEntry:
    """One registered engine."""

    name: str
    config: type | None
    """The dedicated engine's config dataclass; None for ``trainside`` (its settings are ``lm.engine``)."""
    build: Callable[..., Any] | None
    """``(config, *, policy_version, tokenizer) -> engine``; None for ``trainside``."""
    serves_initial_policy: bool = False
    """With ``model`` unset the engine starts from the run's step-0 policy, exported by ``init_run`` (vLLM)."""
    check: Callable[[Any], None] | None = None
    """Refusals of this engine's own (the config instance in, ``ConfigError`` naming the field out)."""

    @property
    def dedicated(self) -> bool:
        return self.build is not None

    @property
    def section(self) -> str:
        """Where a recipe sets this engine: ``lm.vllm``, ``lm.sglang`` or ``lm.dedicated_engine``."""
        return f"lm.{self.name}" if self.name in BUILT_IN_SECTIONS else "lm.dedicated_engine"


_ENTRIES: dict[str, EngineEntry] = {TRAINSIDE: EngineEntry(TRAINSIDE, None, None)}
_DISCOVERED = False


def register_engine(name: str, *, config: type, build: Callable[..., Any], serves_initial_policy: bool = False,
                    check: Callable[[Any], None] | None = None, replace: bool = False) -> None:
    """Register the dedicated engine ``name``: its config dataclass and ``build`` (see the module docstring)."""
    if not (isinstance(name, str) and name and name != TRAINSIDE):
        raise field_error(ConfigError, "engine name", name, f"a non-empty name other than {TRAINSIDE!r}",
                          "pick another name")
    if not (is_dataclass(config) and isinstance(config, type)):
        raise field_error(ConfigError, f"engine {name!r} config", config, "a dataclass",
                          "declare the engine's settings as a frozen dataclass")
    if name in _ENTRIES and not replace and _ENTRIES[name].config is not config:
        raise field_error(ConfigError, "engine name", name, "a name not yet registered",
                          "pick another name or pass replace=True")
    _ENTRIES[name] = EngineEntry(name, config, build, serves_initial_policy, check)


def unregister_engine(name: str) -> None:
    """Forget a registered engine (a test's toy engine); the built-in ones stay."""
    if name != TRAINSIDE:
        _ENTRIES.pop(name, None)


def _discover() -> None:
    """Import every package of ``unirl_core.rollout`` once, so each built-in engine registers itself."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    import unirl_core.rollout as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.ispkg:
            importlib.import_module(f"{package.__name__}.{info.name}")


def engine_names(*, dedicated: bool | None = None) -> list[str]:
    """Registered names (only the dedicated ones, or only the others, when asked)."""
    _discover()
    return sorted(n for n, e in _ENTRIES.items() if dedicated is None or e.dedicated == dedicated)


def engine_entry(name: str, path: str = "lm.deployment.engine") -> EngineEntry:
    """The entry registered as ``name``; ``path`` names the config field in errors."""
    _discover()
    entry = _ENTRIES.get(name)
    if entry is None:
        raise field_error(ConfigError, path, name, f"one of {tuple(engine_names())}",
                          "pick an engine, or register yours with unirl_core.rollout.registry.register_engine")
    return entry
