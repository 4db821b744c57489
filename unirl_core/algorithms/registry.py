"""Algorithms by name: one discriminated config per family section (``lm.algorithm: {name: cispo, ...}``).

Each algorithm module registers itself at import (``register_algorithm``) with its family, its frozen config
dataclass (whose ``name`` field is the discriminator, fixed with ``init=False``) and a factory from that config
to an ``Algorithm``. The modules of this package are imported on the first lookup, so adding a loss is one file
here (plus its recipe and tests) and no edit to a switch elsewhere.

The run config marks its ``algorithm`` fields with ``AlgorithmChoice(family)``; the config loader calls its
``parse_config`` to pick the class by ``name`` (absent: the family's default, so recipes written before the
registry load unchanged). Unknown names and knobs that belong to another algorithm fail with the field, the
value and the fix.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal

from unirl_core.algorithms.base import Algorithm
from unirl_core.errors import ConfigError, field_error

Family = Literal["diffusion", "lm"]
DEFAULT_ALGORITHM: dict[str, str] = {"diffusion": "flow_grpo", "lm": "grpo"}
"""The algorithm a family's section gets when its ``algorithm`` has no ``name``."""


@dataclass(frozen=True)
class AlgorithmEntry:
    """One registered algorithm."""

    name: str
    family: Family
    config: type
    """Frozen dataclass with a ``name`` field (``init=False``) equal to ``name``."""
    build: Callable[[Any], Algorithm]
    """Config -> ``Algorithm`` (usually the algorithm class itself)."""


_ENTRIES: dict[str, AlgorithmEntry] = {}
_DISCOVERED = False


def register_algorithm(name: str, *, family: Family, config: type, build: Callable[[Any], Algorithm],
                       replace: bool = False) -> None:
    """Register ``config`` / ``build`` under ``name`` for ``family`` (``diffusion`` or ``lm``)."""
    if family not in DEFAULT_ALGORITHM:
        raise field_error(ConfigError, "algorithm family", family, f"one of {tuple(DEFAULT_ALGORITHM)}",
                          "register it for the family whose section it trains")
    if not (is_dataclass(config) and getattr(config, "name", None) == name):
        raise field_error(ConfigError, f"{getattr(config, '__name__', config)}.name", getattr(config, "name", None),
                          f"a dataclass whose name field defaults to {name!r}",
                          f"declare name: Literal[{name!r}] = field(default={name!r}, init=False)")
    if name in _ENTRIES and not replace and _ENTRIES[name].config is not config:
        raise field_error(ConfigError, "algorithm name", name, "a name not yet registered",
                          "pick another name or pass replace=True")
    _ENTRIES[name] = AlgorithmEntry(name=name, family=family, config=config, build=build)


def _discover() -> None:
    """Import every module of this package once, so each built-in algorithm registers itself."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    import unirl_core.algorithms as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    _DISCOVERED = True


def algorithm_names(family: Family | None = None) -> list[str]:
    """Registered names, of one family or all."""
    _discover()
    return sorted(n for n, e in _ENTRIES.items() if family is None or e.family == family)


def algorithm_entry(name: str, family: Family, path: str = "algorithm") -> AlgorithmEntry:
    """The entry registered as ``name`` for ``family``; ``path`` names the config field in errors."""
    _discover()
    entry = _ENTRIES.get(name)
    valid = algorithm_names(family)
    if entry is None:
        raise field_error(ConfigError, f"{path}.name", name, f"one of {valid} ({family} algorithms)",
                          "pick a registered name, or register yours with "
                          "unirl_core.algorithms.registry.register_algorithm")
    if entry.family != family:
        raise field_error(ConfigError, f"{path}.name", name, f"one of {valid} ({family} algorithms)",
                          f"{name!r} trains {entry.family} models; use it in the {entry.family} section")
    return entry


def build_algorithm(config: Any) -> Algorithm:
    """The ``Algorithm`` of a registered config instance."""
    _discover()
    entry = _ENTRIES.get(getattr(config, "name", None))
    if entry is None or not isinstance(config, entry.config):
        raise field_error(ConfigError, "algorithm", type(config).__name__, "a registered algorithm config",
                          f"use one of {algorithm_names()} (unirl_core.algorithms.registry)")
    return entry.build(config)


def _owners(knob: str, family: Family) -> list[str]:
    """Registered algorithms with a config field ``knob`` (other families' marked as such)."""
    return [n if _ENTRIES[n].family == family else f"{n} (a {_ENTRIES[n].family} algorithm)"
            for n in algorithm_names() if any(f.name == knob and f.init for f in fields(_ENTRIES[n].config))]


@dataclass(frozen=True)
class AlgorithmChoice:
    """``Annotated`` marker of a family section's ``algorithm`` field: parsed by ``name`` via the registry."""

    family: Family

    def parse_config(self, value: Any, path: str, convert: Callable[[type, Any, str], Any]) -> Any:
        """Config instance for ``value`` (a mapping with an optional ``name``, or an instance already).
        ``convert(cls, data, path)`` is the loader's strict dataclass conversion."""
        if is_dataclass(value) and not isinstance(value, type):
            algorithm_entry(getattr(value, "name", type(value).__name__), self.family, path)
            return value
        if not isinstance(value, dict):
            raise field_error(ConfigError, path, value, "a mapping such as {name: grpo, ...}",
                              "write the algorithm section as key: value pairs")
        name = value.get("name", DEFAULT_ALGORITHM[self.family])
        if not isinstance(name, str):
            raise field_error(ConfigError, f"{path}.name", name, f"one of {algorithm_names(self.family)}",
                              "write the algorithm's name as a string")
        entry = algorithm_entry(name, self.family, path)
        own = {f.name for f in fields(entry.config) if f.init}
        # a field the algorithm fixes (init=False) is written by to_dict; reading back its own value is fine
        fixed = {f.name: f.default for f in fields(entry.config) if not f.init and f.name != "name"}
        for knob in sorted(set(value) & set(fixed)):
            if value[knob] != fixed[knob]:
                raise field_error(ConfigError, f"{path}.{knob}", value[knob], f"{fixed[knob]!r} (fixed by algorithm "
                                  f"{name!r})", f"remove {knob!r}: {name} does not use it as a knob")
        value = {k: v for k, v in value.items() if k not in fixed}
        for knob in sorted(set(value) - own - {"name"}):
            owners = _owners(knob, self.family)
            same_family = [o for o in owners if " " not in o]
            if same_family:
                fix = f"{knob!r} belongs to {' / '.join(owners)}: set {path}.name to it, or remove {knob!r}"
            elif owners:
                fix = f"{knob!r} belongs to {' / '.join(owners)}; remove it ({name}'s fields: {sorted(own)})"
            else:
                fix = f"{name}'s fields: {sorted(own)}"
            raise field_error(ConfigError, f"{path}.{knob}", value[knob],
                              f"a field of algorithm {name!r} ({entry.config.__name__})", fix)
        return convert(entry.config, {k: v for k, v in value.items() if k != "name"}, path)
