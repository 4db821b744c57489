"""Plugins: packages outside the library that register their parts (prompt sources, environments, scorers,
model presets) and ship recipes, like the demos of ``examples/``.

A plugin is a Python module whose import registers what it brings (``register_prompt_source``, ``register_env``,
``register_scorer``, ``register_diffusion_preset``, ...). It is imported:

- when a recipe names it: ``plugins: [my_package.my_world]`` at the top of a recipe (RL, SFT or compose); the
  loader imports every listed module before it validates anything, in every process that rebuilds the config;
- when a recipe found by name lives in a plugin's ``recipes/<kind>/`` folder (the loader imports that plugin);
- when a registry misses a name: every subpackage of the packages in :data:`PLUGIN_PACKAGES` is imported once
  (a Ray actor or a reward server that only sees a name still finds it).

The library itself imports no plugin by a static import (``.importlinter``).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Generic, TypeVar

from unirl_core.errors import ConfigError, field_error

PLUGIN_PACKAGES: list[str] = ["examples"]
"""Top-level packages whose subpackages are plugins (recipes searched by name, imported on a registry miss)."""

_DISCOVERED: set[str] = set()
_LOCK = threading.RLock()  # a lookup from another thread waits for a discovery under way


def import_plugins(modules: Iterable[str], path: str = "plugins") -> None:
    """Import each named module (its import registers its parts); ``ConfigError`` naming ``path`` otherwise."""
    if isinstance(modules, str) or not isinstance(modules, (list, tuple)):
        raise field_error(ConfigError, path, modules, "a list of module names", "e.g. plugins: [examples.shapes]")
    for i, name in enumerate(modules):
        if not isinstance(name, str) or not name:
            raise field_error(ConfigError, f"{path}[{i}]", name, "a module name", "e.g. examples.shapes")
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise field_error(ConfigError, f"{path}[{i}]", name, "an importable module", f"{e}") from e


def plugin_modules() -> list[tuple[str, Path]]:
    """``(module name, folder)`` of every subpackage of :data:`PLUGIN_PACKAGES` (found without importing it)."""
    out = []
    for package in PLUGIN_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        for info in pkgutil.iter_modules(spec.submodule_search_locations):
            if info.ispkg:
                out.append((f"{package}.{info.name}", Path(info.module_finder.path) / info.name))
    return sorted(out)


def discover() -> None:
    """Import every plugin of :data:`PLUGIN_PACKAGES` once (a registry's fallback for a name it does not know)."""
    with _LOCK:
        for name, _ in plugin_modules():
            if name not in _DISCOVERED:
                _DISCOVERED.add(name)
                importlib.import_module(name)


def plugin_recipe_dirs(kind: str) -> list[tuple[str, Path]]:
    """``(plugin module, folder)`` of every plugin shipping recipes of ``kind`` (``rl``, ``sft``, ``compose``) in
    its ``recipes/<kind>/`` folder."""
    return [(name, folder / "recipes" / kind) for name, folder in plugin_modules()
            if (folder / "recipes" / kind).is_dir()]


T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name that the library and its plugins register (prompt sources, presets, warm-start pairs):
    one entry a name (re-registering the same one is a no-op, another one needs ``replace``), a lookup that
    imports the plugins once before it misses (:func:`discover`)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: dict[str, T] = {}

    def add(self, name: str, entry: T, *, replace: bool = False,
            same: Callable[[T, T], bool] = lambda a, b: a is b) -> None:
        """Register ``entry`` as ``name``; ``same(old, new)``: whether a re-registration is the same entry."""
        if name in self.entries and not replace and not same(self.entries[name], entry):
            raise field_error(ConfigError, f"{self.kind} name", name, "a name not yet registered",
                              "pick another name or pass replace=True")
        self.entries[name] = entry

    def find(self, name: Any, *, discover_on_miss: bool = True) -> T | None:
        """The entry registered as ``name``, the plugins imported first when it is not (unless told not to)."""
        if not isinstance(name, str):
            return None
        if name not in self.entries and discover_on_miss:
            discover()
        return self.entries.get(name)

    def names(self) -> list[str]:
        """Every registered name, the plugins' included."""
        discover()
        return sorted(self.entries)
