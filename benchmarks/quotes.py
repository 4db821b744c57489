"""Check that figures quoted in the docs come from the benchmark records they link.

    PYTHONPATH=. python benchmarks/quotes.py              # every page the rule covers; exit 1 on a problem
    PYTHONPATH=. python benchmarks/quotes.py docs/x.md    # some pages

The rule (``benchmarks/README.md``, "Quoting a figure"): a markdown link whose target is a record,
``benchmarks/results/<benchmark>/latest.md`` or ``latest.json`` (relative to the page), must resolve to an existing
record, and every number in the link's text must be one its runs measured (in their ``results``, table or log, as a
number that rounds to it at the quoted precision; never the commit, date or environment). A record of several
cells is quoted through one cell's anchor, ``latest.md#<cell>``, and checked against that cell alone. A link or a
``benchmarks/results/...`` path into the results folder that is not a ``latest.*`` record (or ``golden/``, a test
fixture) is a problem too: flat result files are gone.
"""

from __future__ import annotations

import argparse
import json
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGES = ("README.md", "docs/**/*.md", "benchmarks/README.md", "unirl_core/**/README.md", "examples/**/README.md")

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# a path into the results folder written out (in code or prose), e.g. `benchmarks/results/foo.json`
_PATH = re.compile(r"(?:benchmarks/|(?<=`))results/[\w.+-]+(?:/[\w.+-]*)*")
# a number not inside a name (Qwen3, sd35m, 0.6B): no letter, digit or '.' before it, at most a unit after it
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?=(?:x|s|ms|%|GiB|GB|MiB|MB|KiB|KB|k)?(?![\w.]*\w))")


def pages(root: Path = REPO) -> list[Path]:
    return sorted({p for pattern in PAGES for p in root.glob(pattern) if p.is_file()})


def numbers(text: str) -> list[str]:
    """The numbers quoted in ``text``, as written (commas kept)."""
    return _NUMBER.findall(text)


# what a run measured: its results and its table; never the commit, date, environment, script or description
_MEASURED = ("results", "md", "log")
# any number written in a string of the results (e.g. '0.74x', '1,402 files'), compared as a number
_ANY_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _slug(name: str) -> str:
    """A cell's heading anchor as the docs site writes it (lower case; runs of other characters -> '-')."""
    return re.sub(r"[^a-z0-9_]+", "-", name.lower()).strip("-")


@lru_cache(maxsize=None)
def record_numbers(path: Path, cell: str | None = None) -> tuple[float, ...] | None:
    """The measured numbers of the record ``path`` (of its cell whose anchor is ``cell``); None: no such cell."""
    record = json.loads(path.read_text())
    runs = [record] if "cells" not in record else list(record["cells"].values())
    if cell is not None:
        if "cells" not in record:
            return None
        runs = [v for k, v in record["cells"].items() if _slug(k) == cell]
        if not runs:
            return None
    nums: list[float] = []

    def walk(x) -> None:
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            nums.append(float(x))
        elif isinstance(x, str):
            nums.extend(float(t.replace(",", "")) for t in _ANY_NUMBER.findall(x))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for run in runs:
        for key in _MEASURED:
            walk(run.get(key))
    return tuple(nums)


def in_record(quoted: str, nums: tuple[float, ...]) -> bool:
    """Whether ``quoted`` (e.g. '0.74', '4,895', '-3') is one of ``nums`` at the quoted precision."""
    plain = quoted.replace(",", "")
    places = len(plain.split(".")[1]) if "." in plain else 0
    q = float(plain)
    return any(abs(round(v, places) - q) < 0.5 * 10 ** -(places + 3) for v in nums)


def _is_record(rel: Path) -> bool:
    return len(rel.parts) == 2 and rel.name in ("latest.md", "latest.json")


def check_page(page: Path, results: Path = RESULTS) -> list[str]:
    """Problems with the record links and results paths on one markdown page ('' list: none)."""
    text = page.read_text()
    prose = _CODE.sub("", _FENCE.sub("", text))
    problems = []
    where = page.relative_to(REPO) if page.is_relative_to(REPO) else page
    for label, target in _LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        target_path, _, anchor = target.partition("#")
        path = (page.parent / target_path).resolve()
        if not path.is_relative_to(results):
            continue
        rel = path.relative_to(results)
        if rel.parts and rel.parts[0] == "golden":
            if not path.exists():
                problems.append(f"{where}: [{label}]({target}): no such fixture")
            continue
        if not _is_record(rel):
            problems.append(f"{where}: [{label}]({target}) links a results file that is not a record; link "
                            "benchmarks/results/<benchmark>/latest.md")
            continue
        record = results / rel.parts[0] / "latest.json"
        if not record.exists():
            problems.append(f"{where}: [{label}]({target}): no record {rel.parts[0]}/latest.json")
            continue
        quoted = numbers(label)
        if quoted and not anchor and "cells" in json.loads(record.read_text()):
            problems.append(f"{where}: [{label}]({target}): {rel.parts[0]}/latest.json holds several cells; name the "
                            "one quoted (latest.md#<cell>)")
            continue
        nums = record_numbers(record, anchor or None)
        if nums is None:
            problems.append(f"{where}: [{label}]({target}): {rel.parts[0]}/latest.json has no cell #{anchor}")
            continue
        missing = [n for n in quoted if not in_record(n, nums)]
        if missing:
            cell = f" (cell #{anchor})" if anchor else ""
            problems.append(f"{where}: [{label}]({target}): {', '.join(missing)} not measured in "
                            f"{rel.parts[0]}/latest.json{cell}")
    for mention in (m.rstrip(".") for m in _PATH.findall(text)):
        rel = Path(mention.split("results/", 1)[1].rstrip("/."))
        path = results / rel
        ok = path.exists() and (not rel.parts or rel.parts[0] == "golden" or _is_record(rel) or
                                (len(rel.parts) == 1 and path.is_dir()))
        if not ok:
            problems.append(f"{where}: {mention} is not a record; name benchmarks/results/<benchmark>/latest.md")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("page", nargs="*", help="markdown pages to check (default: every page the rule covers)")
    targets = [Path(a).resolve() for a in ap.parse_args().page] or pages()
    problems = [p for page in targets for p in check_page(page)]
    print("\n".join(problems) or f"{len(targets)} pages: every quoted figure is in its record")
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
