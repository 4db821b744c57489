"""unirl_core must import (every module) without flytekit installed."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import builtins, importlib, pkgutil, sys
real_import = builtins.__import__
def guarded(name, *a, **k):
    if name == "flytekit" or name.startswith("flytekit.") or name.startswith("flytekitplugins"):
        raise ImportError("flytekit is blocked in this test")
    return real_import(name, *a, **k)
builtins.__import__ = guarded
import unirl_core
failed = []
for m in pkgutil.walk_packages(unirl_core.__path__, "unirl_core."):
    if m.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(m.name)
    except ImportError as e:
        if "flytekit" in str(e):
            failed.append(f"{m.name}: {e}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
def test_unirl_core_imports_without_flytekit():
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_no_flytekit_import_statement_in_library():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "unirl_core").rglob("*.py")
                 if any(line.lstrip().startswith(("import flytekit", "from flytekit"))
                        for line in p.read_text().splitlines())]
    assert offenders == []
