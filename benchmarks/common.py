"""Shared helpers for benchmarks: environment record, timing, table output and the results records.

Every benchmark writes one record, ``results/<benchmark>/latest.json`` + ``latest.md``: the environment (hardware,
versions), the git commit it ran at (with a dirty flag) and the date. A benchmark measured in variants (a preset, a
device, a sweep's configurations) keeps one *cell* per variant in that record; running a variant replaces its cell.
History lives in git: a re-run overwrites ``latest``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent


def pin_threads(n: int = 1) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    import torch

    torch.set_num_threads(n)


def environment() -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
           "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for mod in ("pyarrow", "diffusers", "transformers", "flytekit"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return env


def median_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def format_table(header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def report(name: str, title: str, header: list[str], rows: list[list], data: dict, notes: str = "", *,
           cell: str | None = None, headline: str | None = None, description: str | None = None,
           results_dir: Path = RESULTS) -> Path:
    """Print a table and write it with ``data`` as the record of benchmark ``name`` (its ``cell``, if given)."""
    table = format_table(header, rows)
    print(f"\n{title}\n{table}\n")
    md = f"### {title}\n\n{table}\n" + (f"\n{notes}\n" if notes else "")
    return write_record(name, data, md, cell=cell, headline=headline, description=description,
                        results_dir=results_dir)


def provenance() -> dict:
    """The commit this run measured (``dirty``: uncommitted changes in the tree) and the date, ISO 8601 UTC."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""
    # the records themselves do not count: a suite writing several records stays clean after its first
    dirty = bool(git("status", "--porcelain", "-uno", "--", ".", ":!benchmarks/results"))
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()}


def _script_description() -> str:
    doc = (getattr(sys.modules.get("__main__"), "__doc__", None) or "").strip()
    return doc.split("\n\n", 1)[0].replace("\n", " ")


def _script() -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        return Path(main).resolve().relative_to(REPO).as_posix() if main else ""
    except ValueError:
        return Path(main).name


def write_record(benchmark: str, results, md: str, *, cell: str | None = None, env: dict | None = None,
                 headline: str | None = None, description: str | None = None, log: str | None = None,
                 results_dir: Path = RESULTS) -> Path:
    """Write ``results_dir/<benchmark>/latest.json`` and ``latest.md``; returns the json path.

    ``results`` is the measurement (any JSON), ``md`` its table in markdown. With ``cell`` the record keeps the
    other cells and replaces this one; ``description`` (one sentence) defaults to the record's or the script's.
    """
    if "/" in benchmark or (cell and "/" in cell):
        raise ValueError(f"benchmark {benchmark!r} / cell {cell!r}: a name, not a path")
    path = Path(results_dir) / benchmark / "latest.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    if old and ("cells" in old) != (cell is not None):
        # one shape per record: a run written over a record of cells (or a cell into a one-run record) would drop
        # the runs already there
        have = f"cells {sorted(old['cells'])}" if "cells" in old else "one run, no cells"
        raise ValueError(f"{path}: the record holds {have}; write this run "
                         f"{'as one of its cells (cell=...)' if 'cells' in old else 'without a cell'}, or move the "
                         f"record away first")
    entry = {**provenance(), "env": env if env is not None else environment(), "md": md, "results": results}
    if log:
        entry["log"] = log
    record = {"benchmark": benchmark, "description": description or old.get("description") or _script_description(),
              "script": _script() or old.get("script", "")}
    if cell is None:
        record.update(entry)
        if headline:
            record["headline"] = headline
    else:
        if headline or old.get("headline"):
            record["headline"] = headline or old["headline"]
        cells = dict(old.get("cells", {}))
        cells[cell] = entry
        record["cells"] = cells
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    path.with_suffix(".md").write_text(render_md(record))
    return path


def when(entry: dict) -> str:
    """The date of a record or cell: ``date`` when a script wrote it, ``recorded`` (git) when migrated."""
    return entry.get("date") or entry.get("recorded") or ""


def hardware_of(env) -> str:
    if isinstance(env, dict):
        hw = env.get("gpu") or env.get("device_name") or env.get("cpu") or env.get("hardware")
        return str(hw) if hw else ", ".join(f"{k} {v}" for k, v in list(env.items())[:3]) or "not recorded"
    return str(env) if env else "not recorded"


def _provenance_line(e: dict) -> str:
    commit = (e.get("commit") or "unknown")[:10] + (" (dirty)" if e.get("dirty") else "")
    how = "recorded" if "recorded" in e and "date" not in e else "date"
    return f"commit `{commit}`, {how} {when(e)}"


def _env_line(env) -> str:
    if isinstance(env, dict):
        return ", ".join(f"{k} {v}" for k, v in env.items())
    return str(env or "not recorded")


def _entry_md(e: dict) -> str:
    body = e.get("md", "").strip()
    if e.get("log"):
        body += "\n\nLog:\n\n```text\n" + e["log"].rstrip() + "\n```"
    for name, text in sorted((e.get("profile") or {}).items()):
        body += f"\n\nProfile `{name}`:\n\n```text\n" + text.rstrip() + "\n```"
    return f"{body}\n\n_{_provenance_line(e)}; hardware/versions: {_env_line(e.get('env'))}._\n"


def render_md(record: dict) -> str:
    head = f"# {record['benchmark']}\n\n{record.get('description', '')}\n\n"
    if record.get("headline"):
        head += f"Headline: {record['headline']}.\n\n"
    if record.get("script"):
        head += f"Script: `{record['script']}`. "
    if "cells" not in record:
        return head + "\n\n" + _entry_md(record)
    cells = record["cells"]
    rows = [[f"[{c}](#{_anchor(c)})", hardware_of(e.get("env")), (e.get("commit") or "unknown")[:10], when(e)[:10]]
            for c, e in cells.items()]
    out = [head + f"{len(cells)} cells, one per variant; each section below is one run.\n",
           format_table(["cell", "hardware", "commit", "date"], rows)]
    out += [f"## {c}\n\n{_entry_md(e)}" for c, e in cells.items()]
    return "\n\n".join(out)


def _anchor(heading: str) -> str:
    keep = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return keep.replace(" ", "-")


def matmul_peak_tflops(device: str) -> float | None:
    """The measured bf16 matmul peak of this GPU (8192^3 products, best of 10 after 3 warm-ups), the denominator of
    MFU; None on a CPU (no MFU there)."""
    if not device.startswith("cuda"):
        return None
    import time

    import torch

    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for i in range(13):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x @ x
        torch.cuda.synchronize()
        if i >= 3:
            best = min(best, time.perf_counter() - t0)
    return 2 * 8192**3 / best / 1e12
