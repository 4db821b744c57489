"""Every shipped recipe (the library's and the plugins') states on its first line the exact command that runs it:
``# Run: ...`` naming the recipe and the entry point of its kind, whose files exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from unirl_core.compose.config import COMPOSE_RECIPE_DIR
from unirl_core.config.recipes import RECIPE_DIR
from unirl_core.plugins import plugin_recipe_dirs
from unirl_core.sft.config import RECIPE_DIR as SFT_RECIPE_DIR

REPO = Path(__file__).resolve().parents[3]
ENTRY = {"rl": ("scripts/run_local.sh", "workflows/grpo.py grpo"), "sft": ("workflows/sft.py sft",),
         "compose": ("workflows/enhance.py enhance",)}


def _recipes() -> list[tuple[str, Path]]:
    out = []
    for kind, core in (("rl", RECIPE_DIR), ("sft", SFT_RECIPE_DIR), ("compose", COMPOSE_RECIPE_DIR)):
        for folder in [core, *(f for _, f in plugin_recipe_dirs(kind))]:
            out += [(kind, p) for p in sorted(folder.glob("*.yaml"))]
    return out


def test_every_kind_has_recipes():
    kinds = {k for k, _ in _recipes()}
    assert kinds == {"rl", "sft", "compose"} and len(_recipes()) >= 25


@pytest.mark.parametrize("kind,path", _recipes(), ids=lambda x: getattr(x, "stem", x))
def test_recipe_states_the_command_that_runs_it(kind, path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# Run: "), f"{path.name}: first line {first!r}"
    command = first[len("# Run: "):]
    assert re.search(rf"--recipe {re.escape(path.stem)}(\s|$)", command), command
    assert any(entry in command for entry in ENTRY[kind]), (kind, command)
    for ref in re.findall(r"(?:scripts|workflows)/[\w./-]+\.(?:sh|py)", command):
        assert (REPO / ref).is_file(), ref
