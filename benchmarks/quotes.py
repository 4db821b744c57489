"""Check that figures quoted in the docs come from the benchmark records they link.

    PYTHONPATH=. python benchmarks/quotes.py              # every page the rule covers; exit 1 on a problem
    PYTHONPATH=. python benchmarks/quotes.py docs/x.md    # some pages

The rule (``benchmarks/README.md``, "Quoting a figure"): a markdown link whose target is a record,
``benchmarks/results/<benchmark>/latest.md`` or ``latest.json`` (relative to the page), must resolve to an existing
record, and every number in the link's text must be in that record's JSON (a number that rounds to it at the quoted
precision, or a string containing it). A link or a ``benchmarks/results/...`` path into the results folder that is
not a ``latest.*`` record (or ``golden/``, a test fixture) is a problem too: flat result files are gone.
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


@lru_cache(maxsize=None)
def _record_values(path: Path) -> tuple[tuple[float, ...], tuple[str, ...]]:
    nums: list[float] = []
    strs: list[str] = []

    def walk(x) -> None:
        if isinstance(x, bool):
            strs.append(str(x).lower())
        elif isinstance(x, (int, float)):
            nums.append(float(x))
        elif isinstance(x, str):
            strs.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads(path.read_text()))
    return tuple(nums), tuple(strs)


def in_record(quoted: str, record_json: Path) -> bool:
    """Whether ``quoted`` (e.g. '0.74', '4,895', '-3') is in the record: a value rounding to it, or in a string."""
    nums, strs = _record_values(record_json)
    if any(quoted in s for s in strs):
        return True
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
        path = (page.parent / target.split("#", 1)[0]).resolve()
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
        missing = [n for n in numbers(label) if not in_record(n, record)]
        if missing:
            problems.append(f"{where}: [{label}]({target}): {', '.join(missing)} not in {rel.parts[0]}/latest.json")
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
