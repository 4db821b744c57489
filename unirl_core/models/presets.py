"""Model presets a plugin brings: diffusion pipelines and tokenizers built in code, picked by name.

``diffusion.model.source: <name>`` (``register_diffusion_preset(name, family=..., build=...)``) and
``lm.model.tokenizer: <name>`` (``register_tokenizer_preset(name, build=...)``) resolve here before the library's
own presets and ``from_pretrained``. A name without ``/`` that nobody registered, and that is no existing path,
makes the registry import the plugins (``unirl_core.plugins``) once. The shapes world registers ``shapes-sd3``,
``shapes-sd3-init``, ``shapes-sd3-long`` and the tokenizer ``shapes-words`` (``examples/shapes``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unirl_core.errors import ConfigError, field_error
from unirl_core.plugins import Registry


@dataclass(frozen=True)
class DiffusionPreset:
    """A diffusion pipeline built in code (no download; its T5 context defaults to 32 tokens, like the tiny ones)."""

    name: str
    family: str
    """``sd3`` or ``flux``."""
    build: Callable[[Any], Any]
    """``build(model_config)``: the diffusers pipeline (float32, on the CPU; the bundle casts and moves it)."""


DIFFUSION: Registry[DiffusionPreset] = Registry("diffusion preset")
TOKENIZERS: Registry[Callable[[], Any]] = Registry("tokenizer preset")


def register_diffusion_preset(name: str, *, family: str, build: Callable[[Any], Any], replace: bool = False) -> None:
    if family not in ("sd3", "flux"):
        raise field_error(ConfigError, f"diffusion preset {name!r} family", family, "'sd3' or 'flux'", "pick one")
    DIFFUSION.add(name, DiffusionPreset(name, family, build), replace=replace, same=lambda a, b: a.build is b.build)


def register_tokenizer_preset(name: str, *, build: Callable[[], Any], replace: bool = False) -> None:
    TOKENIZERS.add(name, build, replace=replace)


def _miss_discovers(name: Any) -> bool:
    """A plain name (no ``/``, no existing path) may be a plugin's preset; a path or hub id never is."""
    return isinstance(name, str) and "/" not in name and not os.path.exists(name)


def diffusion_preset(name: Any) -> DiffusionPreset | None:
    """The registered diffusion preset ``name``, else None (a directory or hub id)."""
    return DIFFUSION.find(name, discover_on_miss=_miss_discovers(name))


def tokenizer_preset(name: Any) -> Callable[[], Any] | None:
    """The builder of the registered tokenizer preset ``name``, else None."""
    return TOKENIZERS.find(name, discover_on_miss=_miss_discovers(name))
