"""Generated prompt sets by name: ``data.source`` picks one, its settings are the ``data.<section>`` mapping.

``inline`` and ``file`` are the data config's own; every other source is registered:
``register_prompt_source(name, section=..., config=..., build=...)``. The built-in one is ``toy_arithmetic``
(section ``toy``, ``unirl_core/data/toy.py``); a plugin registers its own when imported (the shapes world:
``examples/shapes``, section ``shapes``). A name nobody registered makes the registry import the plugins
(``unirl_core.plugins``) once before it refuses.

What a source gives: ``config``, a frozen dataclass with ``num_prompts`` and ``seed`` (the held-out eval draws
from the same generator at another seed, ``unirl_core/loop/evaluate.py``), and ``build(config)``, the prompt
records in order. ``SourceRegistry`` is also the SFT record sources' registry (``unirl_core/sft/sources.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from unirl_core.errors import ConfigError, field_error
from unirl_core.plugins import Registry, discover
from unirl_core.types import PromptRecord


class SourceRegistry(Registry):
    """Named sources with a settings section each (entries: ``name``, ``section``, ``config``, ...)."""

    def __init__(self, kind: str, own: tuple[str, ...], register_with: str) -> None:
        super().__init__(kind)
        self.own, self.register_with = own, register_with

    def add(self, entry: Any, replace: bool) -> None:
        name = entry.name
        if not (isinstance(name, str) and name and name not in self.own):
            raise field_error(ConfigError, f"{self.kind} name", name, f"a non-empty name other than {self.own}",
                              "pick another name")
        if not (is_dataclass(entry.config) and isinstance(entry.config, type)):
            raise field_error(ConfigError, f"{self.kind} {name!r} config", entry.config, "a dataclass",
                              "declare its settings as a frozen dataclass")
        if not replace and any(e.section == entry.section and e.name != name for e in self.entries.values()):
            raise field_error(ConfigError, f"{self.kind} name", name, "a name and section not yet registered",
                              "pick another name or pass replace=True")
        super().add(name, entry, replace=replace, same=lambda a, b: a.config is b.config)

    def names(self) -> list[str]:
        """The ``data.source`` values: the config's own and the registered ones (the plugins' included)."""
        return [*self.own, *super().names()]

    def get(self, name: str, path: str = "data.source") -> Any:
        """The entry registered as ``name``; ``ConfigError`` naming ``path``, the value and the registered names."""
        entry = self.find(name)
        if entry is None:
            raise field_error(ConfigError, path, name, f"one of {self.names()}", f"pick a {self.kind}, or register "
                              f"yours with {self.register_with} (in a module the recipe lists in plugins:)")
        return entry

    def section_config(self, section: str) -> type | None:
        """The settings class of the source whose section is ``section`` (None: no source has it)."""
        for attempt in range(2):
            for e in self.entries.values():
                if e.section == section:
                    return e.config
            if attempt == 0:
                discover()
        return None

    def section_names(self) -> list[str]:
        discover()
        return sorted(e.section for e in self.entries.values())


@dataclass(frozen=True)
class SourceChoice:
    """``Annotated`` marker of a ``source`` field: one of the registry's names (``ConfigError`` naming the field,
    the value and the registered names otherwise)."""

    registry: SourceRegistry

    def parse_config(self, value: Any, path: str, convert: Callable[[type, Any, str], Any]) -> str:
        value = convert(str, value, path)
        if value not in self.registry.own:
            self.registry.get(value, path)
        return value


@dataclass(frozen=True)
class PromptSourceEntry:
    """One registered prompt source."""

    name: str
    """The ``data.source`` value."""
    section: str
    """The key of its settings under ``data`` (e.g. ``toy`` for ``toy_arithmetic``)."""
    config: type
    """Its settings: a frozen dataclass with ``num_prompts`` and ``seed``."""
    build: Callable[[Any], list[PromptRecord]]
    """``build(config)``: the prompt records, deterministic in the config."""


PROMPT_SOURCES = SourceRegistry("prompt source", ("inline", "file"), "unirl_core.data.register_prompt_source")
PROMPT_SOURCE = SourceChoice(PROMPT_SOURCES)
"""The marker of ``data.source`` (RL and composed runs)."""
OWN_SOURCES = PROMPT_SOURCES.own


def register_prompt_source(name: str, *, section: str, config: type, build: Callable[[Any], list[PromptRecord]],
                           replace: bool = False) -> None:
    """Register the prompt source ``name`` (see the module docstring)."""
    if not (is_dataclass(config) and {"num_prompts", "seed"} <= {f.name for f in fields(config)}):
        raise field_error(ConfigError, f"prompt source {name!r} config", config,
                          "a dataclass with num_prompts and seed fields", "declare its settings as a frozen dataclass")
    PROMPT_SOURCES.add(PromptSourceEntry(name, section, config, build), replace)


prompt_source = PROMPT_SOURCES.get
prompt_source_names = PROMPT_SOURCES.names
section_config = PROMPT_SOURCES.section_config
section_names = PROMPT_SOURCES.section_names
