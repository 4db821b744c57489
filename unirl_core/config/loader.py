"""Strict dataclass <-> dict conversion for run configs and recipes.

Unknown keys, wrong types and values outside a ``Literal`` raise ``ConfigError`` naming the dotted
path, the value and the allowed choices, so a typo in a recipe never silently falls back to a default.

A field typed ``Annotated[T, marker]`` whose marker has ``parse_config(value, path, convert)`` is parsed by
the marker (e.g. ``unirl_core.algorithms.registry.AlgorithmChoice``: a config picked by its ``name``); other
``Annotated`` extras are ignored.

A dataclass with ``SECTIONS_FIELD`` (e.g. ``DataConfig``) takes keys that are none of its fields as the sections of
registered parts (``cls.section_config(key)`` gives each one's config class; a key no part registered is refused
naming the field, the valid fields and the registered sections); ``to_dict`` writes them back as top-level keys, so
a section reads and writes as ``data.shapes: {...}`` although the library does not know it.

A top-level ``plugins`` list (module names, ``unirl_core.plugins``) is imported before anything is checked, so the
names its modules register (prompt sources, environments, presets) are known to the fields that pick them.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Annotated, Any, Literal, Union

import yaml

from unirl_core.errors import ConfigError, field_error
from unirl_core.plugins import import_plugins

T = typing.TypeVar("T")


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from plain data (as parsed from YAML/JSON), checking every field; a top-level
    ``plugins`` list is imported first."""
    if isinstance(data, dict) and data.get("plugins"):
        import_plugins(data["plugins"], f"{path or cls.__name__}.plugins")
    return _convert(cls, data, path or cls.__name__)


def refuse(refused: list[tuple[str, object, object, str, str]]) -> None:
    """Raise a ``ConfigError`` for the first ``(field, value, refused, expected, fix)`` whose ``refused`` is true."""
    for field, value, is_refused, expected, fix in refused:
        if is_refused:
            raise field_error(ConfigError, field, value, expected, fix)


def config_key(obj: Any) -> str:
    """The JSON of a config (section): what a thing built from it is kept by (another value, another thing)."""
    return json.dumps(to_dict(obj), sort_keys=True, default=str)


def to_dict(obj: Any) -> Any:
    """Plain, JSON/YAML-ready data of a (nested) config dataclass."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        sections = getattr(type(obj), "SECTIONS_FIELD", None)
        if sections is not None:
            out.update(out.pop(sections))
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(data: dict, overrides: typing.Sequence[str]) -> dict:
    """Apply ``dotted.key=value`` overrides (values parsed as YAML) to a nested dict, in order."""
    out = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise field_error(ConfigError, "override", item, "'dotted.key=value'", "e.g. train.lr=1e-5")
        key, raw = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p, {}), dict):
                raise field_error(ConfigError, f"override {key}", item, f"'{p}' to be a section",
                                  "override a leaf field, e.g. train.lr=1e-5")
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Annotated:
        inner, *extras = typing.get_args(tp)
        hook = next((m for m in extras if hasattr(m, "parse_config")), None)
        return hook.parse_config(value, path, _convert) if hook is not None else _convert(inner, value, path)
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise field_error(ConfigError, path, value, f"one of {choices}", "pick one of the listed values")
        return value
    if origin in (Union, types.UnionType):
        return _union(tp, value, path)
    if origin in (tuple, list):
        return _sequence(tp, origin, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise field_error(ConfigError, path, value, "a mapping", "write it as key: value pairs")
        kt, vt = typing.get_args(tp) or (Any, Any)
        return {_convert(kt, k, f"{path}.<key>"): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    return _scalar(tp, value, path)


def _dataclass(cls: type, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(value) and isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise field_error(ConfigError, path, value, f"a mapping for {cls.__name__}", "write the section as key: value")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    if getattr(cls, "SECTIONS_FIELD", None) is not None:
        value = _sections(cls, value, fields, path)
    unknown = sorted(set(value) - set(fields))
    if unknown:
        removed = getattr(cls, "REMOVED_FIELDS", {})
        fix = removed.get(unknown[0], f"valid fields: {sorted(fields)}")
        raise field_error(ConfigError, f"{path}.{unknown[0]}", value[unknown[0]], f"a field of {cls.__name__}", fix)
    hints = typing.get_type_hints(cls, include_extras=True)
    kwargs = {}
    for name, f in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], f"{path}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise field_error(ConfigError, f"{path}.{name}", None, "a value (the field is required)",
                              f"add '{name}' to the '{path}' section")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{path}: {e}") from e


class Sectioned:
    """Base of a config dataclass with ``SECTIONS_FIELD`` (a ``dict`` field), ``SECTIONS_KIND`` (what registers the
    sections, for errors) and the static ``section_config(key)`` / ``section_names()`` of its registry."""

    def section(self, key: str) -> Any:
        """The settings under ``data.<key>`` (the registered part's defaults when the recipe has none)."""
        given = getattr(self, self.SECTIONS_FIELD)
        if key in given:
            return given[key]
        tp = self.section_config(key)
        if tp is None:
            raise field_error(ConfigError, f"data.{key}", None, f"the section of a registered {self.SECTIONS_KIND}",
                              f"registered sections: {self.section_names()}")
        return tp()

    def check_sections(self) -> None:
        """Freeze the sections into a dict and refuse one that is not its registered part's settings."""
        given = dict(getattr(self, self.SECTIONS_FIELD))
        object.__setattr__(self, self.SECTIONS_FIELD, given)
        for key, value in given.items():
            if not isinstance(value, self.section_config(key) or ()):
                raise field_error(ConfigError, f"data.{key}", value, f"the settings of a registered "
                                  f"{self.SECTIONS_KIND}'s section", f"registered sections: {self.section_names()}")


def _sections(cls: type, value: dict, fields: dict, path: str) -> dict:
    """``value`` with its keys that are no field of ``cls`` parsed into ``cls.SECTIONS_FIELD`` (see the module
    docstring); that field's own mapping (a config built in code) is parsed the same way."""
    name = cls.SECTIONS_FIELD
    given = value.get(name) or {}
    if not isinstance(given, dict):
        raise field_error(ConfigError, f"{path}.{name}", given, "a mapping of sections", "write key: value pairs")
    raw = {**given, **{k: v for k, v in value.items() if k not in fields}}
    parsed = {}
    for key, v in raw.items():
        tp = cls.section_config(key)
        if tp is None:
            raise field_error(ConfigError, f"{path}.{key}", v, f"a field of {cls.__name__} or the section of a "
                              f"registered {cls.SECTIONS_KIND}", f"valid fields: {sorted(set(fields) - {name})}; "
                              f"registered sections: {cls.section_names()}")
        parsed[key] = _convert(tp, v, f"{path}.{key}")
    return {**{k: v for k, v in value.items() if k in fields}, name: parsed}


def _union(tp: Any, value: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise field_error(ConfigError, path, value, f"a value of {tp}", "this field cannot be null")
    errors = []
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # Optional[X]: X's own error names the field precisely
        return _convert(options[0], value, path)
    for a in options:
        try:
            return _convert(a, value, path)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(f"{path}={value!r}: matches none of {tp}: " + "; ".join(errors))


def _sequence(tp: Any, origin: type, value: Any, path: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise field_error(ConfigError, path, value, "a list", "write it as a YAML list [a, b]")
    args = typing.get_args(tp)
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise field_error(ConfigError, path, value, f"exactly {len(args)} items", "fix the list length")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    item = args[0] if args else Any
    items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


_EXPECTED = {int: ("an integer", "write a whole number"), bool: ("true or false", "write true or false"),
             str: ("a string", "quote the value")}


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise field_error(ConfigError, path, value, "a number", "write a number such as 1e-4")
        return float(value)
    if tp in (int, bool, str):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):  # a bool is an int in Python
            raise field_error(ConfigError, path, value, *_EXPECTED[tp])
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise field_error(ConfigError, path, value, f"a {getattr(tp, '__name__', tp)}", "check the recipe")
