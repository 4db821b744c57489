"""pyproject's requires-python is true: the running interpreter satisfies it, and the code uses no syntax
or (known) stdlib name newer than its lower bound.

What this catches and what it does not: the syntax check is exact (``ast.parse`` with ``feature_version``
rejects grammar the lower-bound Python lacks, e.g. ``type X = ...`` or ``class C[T]``). The stdlib check is
a short list of names added after 3.11 that are easy to reach for; it is not exhaustive (a new method on an
old class, e.g. ``Path.walk``, is not seen). Running the suite on the lower-bound interpreter is the full
check; CI runs CPython 3.11.
"""

import ast
import re
import sys
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
CHECKED_DIRS = ("unirl_core", "tasks", "workflows", "images", "benchmarks", "tests")

# (module, name) -> the Python version that added it (name None: the module itself). Only versions after the
# lower bound count, so the 3.11 entries matter if the bound is ever lowered again (typing.Self was the bug).
NEWER_STDLIB = {
    ("tomllib", None): (3, 11),
    ("typing", "Self"): (3, 11),
    ("typing", "LiteralString"): (3, 11),
    ("typing", "Never"): (3, 11),
    ("typing", "assert_never"): (3, 11),
    ("typing", "assert_type"): (3, 11),
    ("typing", "reveal_type"): (3, 11),
    ("typing", "Required"): (3, 11),
    ("typing", "NotRequired"): (3, 11),
    ("typing", "TypeVarTuple"): (3, 11),
    ("typing", "Unpack"): (3, 11),
    ("typing", "dataclass_transform"): (3, 11),
    ("enum", "StrEnum"): (3, 11),
    ("datetime", "UTC"): (3, 11),
    ("typing", "override"): (3, 12),
    ("typing", "TypeAliasType"): (3, 12),
    ("typing", "get_protocol_members"): (3, 13),
    ("typing", "is_protocol"): (3, 13),
    ("typing", "TypeIs"): (3, 13),
    ("typing", "ReadOnly"): (3, 13),
    ("typing", "NoDefault"): (3, 13),
    ("warnings", "deprecated"): (3, 13),
    ("itertools", "batched"): (3, 12),
    ("copy", "replace"): (3, 13),
}


def _requires_python() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]


def _lower_bound() -> tuple[int, int]:
    m = re.fullmatch(r"\s*>=\s*(\d+)\.(\d+)\s*", _requires_python())
    assert m, f"requires-python {_requires_python()!r} is not a plain '>=X.Y'; update this test with it"
    return int(m.group(1)), int(m.group(2))


def _sources():
    for d in CHECKED_DIRS:
        yield from sorted((ROOT / d).rglob("*.py"))


def test_running_interpreter_satisfies_requires_python():
    running = "{}.{}.{}".format(*sys.version_info[:3])
    assert SpecifierSet(_requires_python()).contains(running), (running, _requires_python())


def test_sources_parse_with_the_lower_bound_grammar():
    floor = _lower_bound()
    files = list(_sources())
    assert len(files) > 50
    bad = []
    for p in files:
        try:
            ast.parse(p.read_text(), filename=str(p), feature_version=floor)
        except SyntaxError as e:
            bad.append(f"{p.relative_to(ROOT)}:{e.lineno}: {e.msg}")
    assert not bad, f"syntax newer than Python {floor[0]}.{floor[1]}:\n" + "\n".join(bad)


def _newer_stdlib_uses(source: str, floor: tuple[int, int]) -> list[tuple[int, str]]:
    """(line, 'module.name needs X.Y') for each use of a listed name added after ``floor``."""
    newer = {k: v for k, v in NEWER_STDLIB.items() if v > floor}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            uses = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            uses = [(node.module, None)] + [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            uses = [(node.value.id, node.attr)]
        else:
            continue
        found += [(node.lineno, f"{m}{'.' + n if n else ''} needs Python {'.'.join(map(str, newer[m, n]))}")
                  for m, n in uses if (m, n) in newer]
    return found


def test_sources_use_no_stdlib_name_newer_than_the_lower_bound():
    floor = _lower_bound()
    bad = [f"{p.relative_to(ROOT)}:{line}: {msg}" for p in _sources()
           for line, msg in _newer_stdlib_uses(p.read_text(), floor)]
    assert not bad, "\n".join(bad)


def test_the_checks_would_catch_what_they_claim():
    # Guards against a check that silently passes everything (e.g. feature_version being ignored).
    import pytest

    with pytest.raises(SyntaxError):
        ast.parse("type Alias = int\n", feature_version=(3, 11))
    with pytest.raises(SyntaxError):
        ast.parse("def f[T](x: T) -> T: return x\n", feature_version=(3, 11))
    ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 11))
    src = "import tomllib\nfrom typing import Literal, Self\nimport typing\nx: typing.override\n"
    assert [line for line, _ in _newer_stdlib_uses(src, (3, 10))] == [1, 2, 4]
    assert [line for line, _ in _newer_stdlib_uses(src, (3, 11))] == [4]
    assert _newer_stdlib_uses(src, (3, 12)) == []
