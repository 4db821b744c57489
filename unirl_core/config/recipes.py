"""Recipes: YAML run configs shipped in the package or in a plugin's ``recipes/<kind>/`` folder (by name), or given as
a file path. A recipe found in a plugin's folder gets that plugin listed in its ``plugins`` (imported before the
config is validated, here and in every process that rebuilds it; ``unirl_core.plugins``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from unirl_core.config.loader import apply_overrides, from_dict
from unirl_core.config.run import RunConfig
from unirl_core.errors import ConfigError, field_error
from unirl_core.plugins import import_plugins, plugin_recipe_dirs

RECIPE_DIR = Path(__file__).resolve().parent / "recipes"


def _folders(folder: Path, kind: str) -> list[tuple[str | None, Path]]:
    """The library's folder of this kind, then every plugin's ``recipes/<kind>/``."""
    return [(None, folder), *plugin_recipe_dirs(kind)]


def recipe_names(folder: Path = RECIPE_DIR, kind: str = "rl") -> list[str]:
    """Names of the recipes of this kind: shipped with the package (``folder``: the RL recipes by default) and with
    the plugins (``kind``: ``rl``, ``sft`` or ``compose``)."""
    return sorted({p.stem for _, f in _folders(folder, kind) for p in f.glob("*.yaml")})


def _find(name_or_path: str, folder: Path, kind: str, label: str) -> tuple[Path, str | None]:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p, None
    for plugin, f in _folders(folder, kind):
        shipped = f / f"{name_or_path}.yaml"
        if shipped.is_file():
            return shipped, plugin
    raise field_error(ConfigError, "recipe", name_or_path, f"a shipped {label} {recipe_names(folder, kind)} or a "
                      ".yaml file", "check the spelling or pass a path to your own recipe file")


def recipe_path(name_or_path: str, folder: Path = RECIPE_DIR, label: str = "recipe", kind: str = "rl") -> Path:
    """The file of a recipe: a .yaml path as given, else the recipe of that name (library first, then plugins)."""
    return _find(name_or_path, folder, kind, label)[0]


def load_recipe_dict(name_or_path: str, overrides: Sequence[str] = (), folder: Path = RECIPE_DIR,
                     label: str = "recipe", kind: str = "rl") -> dict:
    """The recipe's YAML mapping with ``a.b=value`` overrides applied (not validated yet); its ``plugins`` (with
    the plugin whose folder holds it) are imported."""
    path, plugin = _find(name_or_path, folder, kind, label)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {path.name}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise field_error(ConfigError, f"recipe {path.name}", type(data).__name__, "a mapping at the top level",
                          "start the file with 'name: ...' and the sections")
    data = apply_overrides(data, overrides)
    if plugin is not None and plugin not in (data.get("plugins") or []):
        data["plugins"] = [plugin, *(data.get("plugins") or [])]
    if "plugins" in data:
        import_plugins(data["plugins"])
    return data


def load_recipe(name_or_path: str, overrides: Sequence[str] = ()) -> RunConfig:
    """Parse a recipe (shipped name or YAML path), apply ``a.b=value`` overrides, validate everything. The recipe's
    ``cluster:`` section (pods, resources, GPU kind: the Flyte layer's ``tasks.run_types.ClusterConfig``) is not
    part of the run config and is left out here."""
    data = load_recipe_dict(name_or_path, overrides)
    data.pop("cluster", None)
    return from_dict(RunConfig, data, "recipe")
