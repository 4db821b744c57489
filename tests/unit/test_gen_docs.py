"""The generated docs are current (README's recipe table, docs/reference/config.md), the reference covers every
field a shipped recipe sets and documents every field, and the READMEs stay within their line budgets."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
gen_docs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gen_docs", gen_docs)  # its dataclasses look their module up
_spec.loader.exec_module(gen_docs)

FIX = "run `python scripts/gen_docs.py` and commit the result"


def test_readme_recipe_table_is_current():
    text = gen_docs.README.read_text()
    assert gen_docs.readme_with_table(text) == text, f"README.md's recipe table is stale: {FIX}"


def test_a_stale_table_is_rewritten():
    text = gen_docs.README.read_text()
    stale = text.replace("| `tiny-grpo` |", "| `tiny-grpo-renamed` |")
    assert f"| `{gen_docs.default_recipe()}` (default) |" in text
    assert stale != text and gen_docs.readme_with_table(stale) == text


def test_every_recipe_is_in_the_readme_table():
    text = gen_docs.README.read_text()
    for _, path in gen_docs.recipe_files():
        assert f"| `{path.stem}` |" in text or f"| `{path.stem}` (default) |" in text, path.stem


def test_config_reference_is_current():
    assert gen_docs.CONFIG_MD.is_file(), f"docs/reference/config.md is missing: {FIX}"
    assert gen_docs.CONFIG_MD.read_text() == gen_docs.config_reference(), f"docs/reference/config.md is stale: {FIX}"


def test_every_config_field_has_a_doc():
    assert gen_docs.undocumented() == [], "add an attribute docstring under each of these fields"


def _recipe_paths(data: dict, sections: dict[str, bool], prefix: str = ""):
    """The dotted paths a recipe sets: into a mapping where the config has a section, else the key itself."""
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and sections.get(path):
            yield from _recipe_paths(value, sections, path)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value) and sections.get(path + "[]"):
            for v in value:
                yield from _recipe_paths(v, sections, path + "[]")
        else:
            yield path


@pytest.fixture(scope="module")
def reference_paths() -> dict[str, dict[str, bool]]:
    return {kind: gen_docs.config_paths(root) for kind, root, _ in gen_docs.roots()}


@pytest.mark.parametrize("kind,path", gen_docs.recipe_files(), ids=lambda x: getattr(x, "stem", x))
def test_every_field_of_a_recipe_is_in_the_reference(kind, path, reference_paths):
    text = gen_docs.CONFIG_MD.read_text()
    paths = reference_paths[kind]
    for p in _recipe_paths(yaml.safe_load(path.read_text()), paths):
        assert p in paths and f"| `{p}` |" in text, f"{path.name}: {p} is not in docs/reference/config.md"


def test_the_recipe_walk_sees_nested_fields(reference_paths):
    paths = reference_paths["rl"]
    got = set(_recipe_paths({"diffusion": {"algorithm": {"name": "nft", "kl_beta": 0.1}},
                             "reward": {"components": [{"name": "jpeg", "weight": 1.0}]}}, paths))
    assert got == {"diffusion.algorithm.name", "diffusion.algorithm.kl_beta", "reward.components[].name",
                   "reward.components[].weight"}
    assert "diffusion.algorithm.no_such_knob" not in paths


def test_readme_is_at_most_200_lines():
    n = len(gen_docs.README.read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines: move detail to docs/"


@pytest.mark.parametrize("readme", sorted((REPO / "unirl_core").glob("*/README.md")),
                         ids=lambda p: p.parent.name)
def test_package_readme_is_at_most_100_lines(readme):
    n = len(readme.read_text().splitlines())
    assert n <= 100, f"{readme.relative_to(REPO)} has {n} lines: keep what a contributor needs, move the rest to docs/"


def test_readme_links_resolve():
    """Every relative link of README.md names a file of the repository (benchmark records: their own test)."""
    text = gen_docs.README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link and not link.startswith("benchmarks/results/")]
    assert len(local) >= 10, local  # the docs pages at least
    missing = [link for link in local if not (REPO / link).exists()]
    assert missing == [], f"README.md links to missing files: {missing}"


def test_package_and_example_readme_paths_resolve():
    """Every relative link of a package or example README, and every repository path it names in code
    (`docs/execution.md`, `unirl_core/loop/local.py`), exists (mkdocs --strict checks only the pages under docs/)."""
    named = re.compile(r"`((?:docs|unirl_core|examples|benchmarks|scripts|tasks|workflows|tests)/[\w./-]*)`")
    checked, missing = 0, []
    for page in sorted([*REPO.glob("unirl_core/**/README.md"), *REPO.glob("examples/**/README.md")]):
        text = page.read_text()
        links = [page.parent / link for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in link]
        for path in [*links, *(REPO / p.rstrip(".") for p in named.findall(text))]:
            checked += 1
            if not path.exists():
                missing.append(f"{page.relative_to(REPO)}: {path.resolve()}")
    assert checked >= 50 and missing == [], missing


def test_readme_module_map_follows_the_import_contract():
    """The module map's rows of unirl_core packages are .importlinter's layers, top to bottom, with the same packages."""
    text = (REPO / ".importlinter").read_text()
    block = text.split("[importlinter:contract:layers]", 1)[1].split("layers =", 1)[1].split("\n[", 1)[0]
    layers = [sorted(p.strip() for p in line.split("|")) for line in block.strip().splitlines() if line.strip()]
    rows = re.findall(r"^\| ([a-z, ]+) \| `unirl_core/", gen_docs.README.read_text(), flags=re.M)
    assert [sorted(p.strip() for p in row.split(",")) for row in rows] == layers
