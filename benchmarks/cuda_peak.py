"""What is allocated at a CUDA process's peak: record the caching allocator's history, replay it, name the owners.

``torch.cuda.max_memory_allocated`` says how high a run went, not what was alive up there. ``start()`` turns on
the allocator's history (every alloc / free with its Python stack); ``report(path)`` replays the recorded events,
finds the moment allocated memory was highest, and writes the allocations alive then, grouped by the innermost
frame outside torch (the code that asked for the memory), largest first, plus the allocation that set the peak.
Allocations made before the recorded window (the ring buffer keeps the last ``max_entries`` events) show as one
"before the window" line, computed from ``memory_allocated()`` at the end minus the window's net change.

    from benchmarks import cuda_peak
    cuda_peak.start()
    ...                      # the run
    cuda_peak.report("peak.txt")

Used by ``bench_grpo_recipe.py --memory-report DIR`` (both sides). A diagnostic: recording Python stacks slows
every allocation, so a run with it on is not a timing run.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

_SKIP = ("/torch/", "<frozen", "/contextlib.py", "/functools.py", "/threading.py")


def start(max_entries: int = 400_000) -> None:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, context="alloc", stacks="python")


def _owner(frames: list[dict], depth: int = 3) -> str:
    """The innermost ``depth`` frames outside torch and the standard library's plumbing, innermost first."""
    picked = [f for f in frames if not any(s in f.get("filename", "") for s in _SKIP)]
    if not picked:
        picked = frames
    out = []
    for f in picked[:depth]:
        name = f.get("filename", "?")
        for marker in ("/site-packages/", "/unirl_core/", "/benchmarks/"):
            if marker in name:
                name = marker.strip("/") + "/" + name.split(marker, 1)[1]
                break
        else:  # no folder of the machine in the report: the file's last three path parts
            name = "/".join(name.split("/")[-3:])
        out.append(f"{name}:{f.get('line', '?')} {f.get('name', '?')}")
    return " <- ".join(out) or "?"


def analyse(snapshot: dict, allocated_now: int, device: int = 0, top: int = 30) -> str:
    """The report's text for one device of a ``torch.cuda.memory._snapshot()``."""
    traces = snapshot["device_traces"][device]
    events = [e for e in traces if e["action"] in ("alloc", "free_completed")]
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"] for e in events)
    baseline = allocated_now - net  # allocated before the first recorded event (0 when the window holds it all)
    total, peak, peak_i = baseline, baseline, -1
    for i, e in enumerate(events):
        total += e["size"] if e["action"] == "alloc" else -e["size"]
        if total > peak:
            peak, peak_i = total, i
    live: dict[int, dict] = {}
    for e in events[:peak_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        g = groups[_owner(e.get("frames", []))]
        g[0] += e["size"]
        g[1] += 1
    mib = 2**20
    lines = [f"events in the window: {len(events)} (of {len(traces)} trace entries); before the window: "
             f"{baseline / mib:.1f} MiB; peak allocated: {peak / mib:.1f} MiB at event {peak_i}; "
             f"allocated at the end: {allocated_now / mib:.1f} MiB",
             "live at the peak, by owner (MiB, count):"]
    if baseline:
        lines.append(f"{baseline / mib:10.1f} {'':>6}  (allocated before the recorded window)")
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / mib:10.1f} {count:6d}  {key}")
    if peak_i >= 0:
        e = events[peak_i]
        lines.append(f"the allocation that set the peak: {e['size'] / mib:.1f} MiB at "
                     f"{_owner(e.get('frames', []), depth=8)}")
    return "\n".join(lines) + "\n"


def report(path: str | Path, top: int = 30) -> str:
    import torch

    text = analyse(torch.cuda.memory._snapshot(), torch.cuda.memory_allocated(), torch.cuda.current_device(), top)
    torch.cuda.memory._record_memory_history(enabled=None)
    Path(path).write_text(text)
    return text
