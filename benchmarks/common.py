"""Shared helpers for benchmarks: environment record, timing, table + JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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


def report(name: str, title: str, header: list[str], rows: list[list], data: dict, notes: str = "") -> None:
    """Print a table, write results/<name>.json and results/<name>.md."""
    env = environment()
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    table = "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
    print(f"\n{title}\n{table}\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"name": name, "env": env, "results": data}, indent=2))
    env_line = ", ".join(f"{k} {v}" for k, v in env.items())
    md = f"### {title}\n\n{table}\n\n{notes}\n\n_Hardware/versions: {env_line}._\n"
    (RESULTS / f"{name}.md").write_text(md)
