"""What the enhancer's warm start trains on, by name: ``enhancer.warm_start.pairs`` picks a registered maker.

``copy`` (each prompt with itself) is built in; a plugin registers others when imported
(``register_warm_pairs(name, make=..., check=..., check_run=...)``; the composed enhancement demo's ``add_colour``:
``examples/compose_enhance``). A name nobody registered makes the registry import the plugins
(``unirl_core.plugins``) once before it refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unirl_core.errors import ConfigError, field_error
from unirl_core.plugins import Registry
from unirl_core.types import PromptRecord


@dataclass(frozen=True)
class WarmPairs:
    """One registered pair maker."""

    name: str
    make: Callable[[list[PromptRecord], Any], list[tuple[str, str]]]
    """``make(records, warm_start_config)``: the (prompt, completion) texts, in order."""
    check: Callable[[Any], None] | None = None
    """Refusals of the warm-start section (``ConfigError`` naming the field), when this maker is picked."""
    check_run: Callable[[Any], None] | None = None
    """Refusals of the whole composed run (e.g. what the prompt set must be), when the warm start runs."""


PAIRS: Registry[WarmPairs] = Registry("warm-start pairs")


def register_warm_pairs(name: str, *, make: Callable[[list[PromptRecord], Any], list[tuple[str, str]]],
                        check: Callable[[Any], None] | None = None, check_run: Callable[[Any], None] | None = None,
                        replace: bool = False) -> None:
    PAIRS.add(name, WarmPairs(name, make, check, check_run), replace=replace, same=lambda a, b: a.make is b.make)


def warm_pairs_names() -> list[str]:
    return PAIRS.names()


def warm_pairs_entry(name: str, path: str = "enhancer.warm_start.pairs") -> WarmPairs:
    """The maker registered as ``name``; ``ConfigError`` naming ``path``, the value and the registered names."""
    entry = PAIRS.find(name)
    if entry is None:
        raise field_error(ConfigError, path, name, f"one of {warm_pairs_names()}",
                          "copy teaches the enhancer to repeat its prompt; register other pairs with "
                          "unirl_core.compose.warm_pairs.register_warm_pairs")
    return entry


register_warm_pairs("copy", make=lambda records, _cfg: [(r.prompt, r.prompt) for r in records])
