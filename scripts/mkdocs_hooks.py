"""MkDocs hooks (mkdocs.yml `hooks:`): the benchmark records join the site, so links to them resolve under
`mkdocs build --strict`.

`docs/benchmarks.md` links each record as `../benchmarks/results/<benchmark>/latest.md` (a path that also works
when the Markdown is read on its own). The records live outside `docs/`, so they are added to the site's files
under `benchmarks/results/`, and links that climb out of `docs/` to them are rewritten to that place.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path("benchmarks") / "results"


def on_files(files, config):
    repo = Path(config["config_file_path"]).parent
    for path in sorted((repo / RESULTS).glob("*/*")):
        if path.is_file() and path.suffix in (".md", ".json"):
            files.append(File(path.relative_to(repo).as_posix(), str(repo), config["site_dir"],
                              config["use_directory_urls"]))
    return files


def _folder_page(repo: Path, folder: str) -> str:
    """A link to a record's folder points at its ``latest.md``, or at its only file (a folder is no page)."""
    here = repo / RESULTS / folder
    if (here / "latest.md").is_file():
        return f"{folder}/latest.md"
    only = sorted(p.name for p in here.glob("*") if p.is_file())
    return f"{folder}/{only[0]}" if len(only) == 1 else f"{folder}/"


def on_page_markdown(markdown, page, config, files):
    repo = Path(config["config_file_path"]).parent
    depth = page.file.src_uri.count("/")
    outside = "../" * (depth + 1) + RESULTS.as_posix() + "/"
    inside = "../" * depth + RESULTS.as_posix() + "/"
    markdown = re.sub(r"\]\(" + re.escape(outside), "](" + inside, markdown)
    return re.sub(r"\]\(" + re.escape(inside) + r"([^)/#]+)/\)",
                  lambda m: "](" + inside + _folder_page(repo, m.group(1)) + ")", markdown)
