"""SFT record sources by name: ``data.source`` of an SFT recipe picks one, its settings are ``data.<section>``.

``jsonl`` (``data.path``) is the data config's own; every other source is registered:
``register_record_source(name, section=..., config=..., build=..., families=...)``. The built-in one is
``toy_arithmetic`` (section ``toy``: the toy task's prompts with their answers, for an LM); a plugin registers its
own when imported (the shapes world's captioned images: ``examples/shapes``). A name nobody registered makes the
registry import the plugins (``unirl_core.plugins``) once before it refuses.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unirl_core.data.sources import SourceChoice, SourceRegistry
from unirl_core.data.toy import ToyArithmeticConfig
from unirl_core.errors import ConfigError, field_error


@dataclass(frozen=True)
class RecordSourceEntry:
    """One registered record source."""

    name: str
    section: str
    """The key of its settings under ``data``."""
    config: type
    """Its settings (a frozen dataclass; the recipe's ``data.<section>``, else its defaults)."""
    build: Callable[[Any], list] | str
    """``build(sft_config) -> records`` (``TextRecord`` / ``ImageRecord`` of ``unirl_core.sft.records``), or a
    ``"module:attr"`` string imported on first use."""
    families: tuple[str, ...]
    """The SFT families it feeds (``diffusion``, ``lm``)."""

    def records(self, cfg: Any) -> list:
        build = self.build
        if isinstance(build, str):
            module, attr = build.split(":")
            build = getattr(importlib.import_module(module), attr)
        return build(cfg)


RECORD_SOURCES = SourceRegistry("record source", ("jsonl",), "unirl_core.sft.sources.register_record_source")
RECORD_SOURCE = SourceChoice(RECORD_SOURCES)
"""The marker of an SFT recipe's ``data.source``."""


def register_record_source(name: str, *, section: str, config: type, build: Callable[[Any], list] | str,
                           families: tuple[str, ...], replace: bool = False) -> None:
    """Register the record source ``name`` (see the module docstring)."""
    if not families or not set(families) <= {"diffusion", "lm"}:
        raise field_error(ConfigError, f"record source {name!r} families", families,
                          "a non-empty subset of ('diffusion', 'lm')", "name the families it feeds")
    RECORD_SOURCES.add(RecordSourceEntry(name, section, config, build, tuple(families)), replace)


record_source = RECORD_SOURCES.get
section_config = RECORD_SOURCES.section_config
section_names = RECORD_SOURCES.section_names

register_record_source("toy_arithmetic", section="toy", config=ToyArithmeticConfig,
                       build="unirl_core.sft.records:toy_records", families=("lm",))
