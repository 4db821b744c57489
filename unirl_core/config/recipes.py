"""Recipes: YAML run configs shipped in the package (by name) or given as a file path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from unirl_core.config.loader import apply_overrides, from_dict
from unirl_core.config.run import RunConfig
from unirl_core.errors import ConfigError, field_error

RECIPE_DIR = Path(__file__).resolve().parent / "recipes"


def recipe_names(folder: Path = RECIPE_DIR) -> list[str]:
    """Names of the recipes shipped with the package (in ``folder``: the RL recipes by default)."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def recipe_path(name_or_path: str, folder: Path = RECIPE_DIR, kind: str = "recipe") -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    shipped = folder / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    raise field_error(ConfigError, "recipe", name_or_path, f"a shipped {kind} {recipe_names(folder)} or a .yaml file",
                      "check the spelling or pass a path to your own recipe file")


def load_recipe_dict(name_or_path: str, overrides: Sequence[str] = (), folder: Path = RECIPE_DIR,
                     kind: str = "recipe") -> dict:
    """The recipe's YAML mapping with ``a.b=value`` overrides applied (not validated yet)."""
    path = recipe_path(name_or_path, folder, kind)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {path.name}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise field_error(ConfigError, f"recipe {path.name}", type(data).__name__, "a mapping at the top level",
                          "start the file with 'name: ...' and the sections")
    return apply_overrides(data, overrides)


def load_recipe(name_or_path: str, overrides: Sequence[str] = ()) -> RunConfig:
    """Parse a recipe (shipped name or YAML path), apply ``a.b=value`` overrides, validate everything."""
    return from_dict(RunConfig, load_recipe_dict(name_or_path, overrides), "recipe")
