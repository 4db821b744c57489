"""Golden runs: what a refactor must not change, recorded on one commit and replayed on another.

    python scripts/golden_runs.py record                      # every case on this checkout -> a record
    python scripts/golden_runs.py compare RECORD.json         # the same cases on this checkout, bitwise vs RECORD
    python scripts/golden_runs.py compare RECORD.json --cases tiny-grpo/inprocess

A case is one shipped recipe run for a few steps in a fresh single-threaded process (in-process, in a local Ray
pool, a composed run or an SFT run). Its record holds every step's deterministic metrics (rewards, ratios,
losses, KL; timings and byte counts of background writes are left out) and the sha256 of every weights and state
file of each run's last version, as the manifest lists them. ``compare`` fails on the first difference it finds
in a case, naming the case, step and key.

The ``resume`` cases check that a checkpoint written by the recorded commit still resumes bit for bit: the record
holds a run stopped after ``RESUME_FIRST`` steps and resumed in a new process; ``compare`` makes a git worktree of
the record's commit, runs the first steps there (the old code writes the checkpoint), resumes here, and compares
the resumed steps and the last version (weights and full train state) with the record's.
Same machine kind and thread count as the record: float results differ across CPU microarchitectures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RL_INPROCESS = ["tiny-grpo", "tiny-flow-grpo", "tiny-dapo", "tiny-cispo", "tiny-flow-dppo", "tiny-mixgrpo",
                "tiny-nft", "tiny-grpo-async", "tiny-grpo-guard", "tiny-agent-calc", "shapes-flow-grpo",
                "shapes-nft"]
RL_POOL = ["tiny-grpo", "tiny-flow-grpo", "tiny-grpo-async"]
COMPOSE = ["shapes-enhance"]
COMPOSE_POOL = ["shapes-enhance"]
SFT = ["sft-toy-sums", "sft-shapes"]  # the other two read a records file the user writes
RESUME = ["tiny-grpo", "tiny-flow-grpo"]
STEPS = 3
# the recorded case ran tiny-agent-calc from random init; the recipe now starts from its SFT export
RECIPE_EXTRA = {"tiny-agent-calc": ["lm.model.model=tiny"]}
RESUME_FIRST = 2  # the resume cases: steps run by the recorded commit before this checkout runs the rest
# toy-sums is left out: its model is the export of the SFT recipe sft-toy-sums (a case of its own)

# metrics that measure time, or bytes that depend on what a background thread had finished when they were read
VOLATILE = ("time/", "/time_", "idle_frac", "_seconds", "_s", "/seconds", "throughput", "per_s", "tokens_per", "/previous_write",
            "pending_write")


PATH_METRICS = ("rollout/with_trainer", "rollout/trainer_restored", "rollout/decode_width",
                "pool/publish_delta")
"""Metrics that say how a step ran (the trainer's module sampled, it restored a version, the decode width, the
publish went as a delta), not what it computed: a record from before they existed lacks them, and their appearance
is not a difference (their values are still compared where the record has them)."""


def all_cases() -> list[str]:
    return ([f"{r}/inprocess" for r in RL_INPROCESS] + [f"{r}/pool" for r in RL_POOL]
            + [f"{r}/compose" for r in COMPOSE] + [f"{r}/compose-pool" for r in COMPOSE_POOL]
            + [f"{r}/sft" for r in SFT] + [f"{r}/resume" for r in RESUME])


def deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not any(s in k for s in VOLATILE) and not k.endswith("_s")}


def last_versions(root: Path) -> dict[str, dict[str, str]]:
    """``{run folder: {file: sha256}}`` of the newest complete version of every run under ``root`` (weights and
    state files; the JSON files hold paths of this machine and are left out)."""
    out = {}
    for manifest in sorted(root.rglob("step-*/manifest.json")):
        run = str(manifest.parent.parent.relative_to(root))
        files = json.loads(manifest.read_text())["files"]
        step = manifest.parent.name
        if run in out and out[run]["step"] > step:
            continue
        out[run] = {"step": step, **{name: info["sha256"] for name, info in sorted(files.items())
                                     if not name.endswith(".json")}}
    return out


def run_case(case: str, root: Path, steps: int, resume_at: int | None = None) -> dict:
    """One case in this process (called in a fresh subprocess by ``record`` / ``compare``)."""
    import torch

    torch.set_num_threads(1)
    recipe, kind = case.split("/")
    common = [f"checkpoint.root={root}", "report.tensorboard=false", "report.progress=false"]
    if kind in ("pool", "compose-pool"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    if kind in ("inprocess", "pool", "resume"):
        from unirl_core.config.recipes import load_recipe
        from unirl_core.loop.local import run_local

        extra = ["pool.execution=pool"] if kind == "pool" else []
        total = resume_at if resume_at is not None else steps
        cfg = load_recipe(recipe, [*common, f"loop.total_steps={total}", f"name={recipe}", *extra,
                                   *RECIPE_EXTRA.get(recipe, [])])
        hist = run_local(cfg, resume_from="never" if kind != "resume" or resume_at is not None else "latest",
                         progress=False)
    elif kind in ("compose", "compose-pool"):
        from unirl_core.compose.config import load_compose_recipe
        from unirl_core.compose.local import run_compose_local

        extra = ["pool.execution=pool"] if kind == "compose-pool" else []
        cfg = load_compose_recipe(recipe, [*common, f"loop.total_steps={steps}", f"name={recipe}", *extra])
        hist = run_compose_local(cfg, resume_from="never", progress=False)
    elif kind == "sft":
        from unirl_core.sft.config import load_sft_recipe
        from unirl_core.sft.local import run_sft

        cfg = load_sft_recipe(recipe, [f"checkpoint.root={root}", f"loop.total_steps={steps}"])
        hist = run_sft(cfg, resume_from="never", progress=False)
    else:
        raise SystemExit(f"unknown case kind {kind!r} in {case!r}")
    if kind in ("pool", "compose-pool"):
        from unirl_core.pool import cluster

        cluster.close_pool()
    return {"history": [deterministic(m) for m in hist], "versions": last_versions(root)}


def _subprocess_case(case: str, steps: int, cwd: Path, root: Path, resume_at: int | None = None) -> dict:
    out = root / "case.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(cwd)}
    cmd = [sys.executable, str(cwd / "scripts" / "golden_runs.py"), "case", case, "--root", str(root / "runs"),
           "--steps", str(steps), "--out", str(out)]
    if resume_at is not None:
        cmd += ["--resume-at", str(resume_at)]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"case {case} failed in {cwd} (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _commit(cwd: Path = REPO) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout.strip()


def record(cases: list[str], out: Path) -> int:
    """Run ``cases`` and write the record after each one (a case already in ``out`` from this commit is kept)."""
    import torch

    rec = {"commit": _commit(), "machine": platform.processor() or platform.machine(), "cpu": _cpu_model(),
           "python": platform.python_version(), "torch": torch.__version__, "steps": STEPS,
           "resume_first": RESUME_FIRST, "cases": {}}
    if out.exists():
        old = json.loads(out.read_text())
        if old.get("commit") == rec["commit"]:
            rec["cases"] = old["cases"]
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = []
    for case in cases:
        if case in rec["cases"]:
            continue
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                if case.endswith("/resume"):  # stopped after RESUME_FIRST steps, resumed in a new process
                    _subprocess_case(case, STEPS + 1, REPO, Path(tmp), resume_at=RESUME_FIRST)
                    rec["cases"][case] = _subprocess_case(case, STEPS + 1, REPO, Path(tmp))
                else:
                    rec["cases"][case] = _subprocess_case(case, STEPS, REPO, Path(tmp))
        except RuntimeError as e:
            failed.append(case)
            print(e, flush=True)
            continue
        print(f"{case:32s} {len(rec['cases'][case]['history'])} steps  {time.perf_counter() - t0:6.1f} s", flush=True)
        out.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def _diff(case: str, want: dict, got: dict) -> list[str]:
    problems = []
    if len(want["history"]) != len(got["history"]):
        problems.append(f"{case}: {len(got['history'])} steps, recorded {len(want['history'])}")
    for i, (w, g) in enumerate(zip(want["history"], got["history"])):
        w, g = deterministic(w), deterministic(g)  # a record of an older VOLATILE list too
        for key in sorted(set(w) | set(g)):
            if key not in w and key in PATH_METRICS:  # which path sampled, new since the record: not a result
                continue
            if w.get(key) != g.get(key) and not (w.get(key) != w.get(key) and g.get(key) != g.get(key)):  # NaN == NaN
                problems.append(f"{case}: step {i + 1} {key}: {g.get(key)!r}, recorded {w.get(key)!r}")
    if want["versions"] != got["versions"]:
        for run in sorted(set(want["versions"]) | set(got["versions"])):
            if want["versions"].get(run) != got["versions"].get(run):
                problems.append(f"{case}: last version of {run}: {got['versions'].get(run)}, recorded "
                                f"{want['versions'].get(run)}")
    return problems


def _resume_from_commit(case: str, commit: str, steps: int, tmp: Path) -> dict:
    """The first ``RESUME_FIRST`` steps with ``commit``'s code (a git worktree), the rest with this checkout's."""
    tree = tmp / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True,
                   capture_output=True)
    try:
        _subprocess_case(case, steps, tree, tmp, resume_at=RESUME_FIRST)
        return _subprocess_case(case, steps, REPO, tmp)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)


def compare(record_path: Path, cases: list[str] | None) -> int:
    rec = json.loads(record_path.read_text())
    problems, n = [], 0
    for case in cases or sorted(rec["cases"]):
        t0 = time.perf_counter()
        steps = rec["steps"] + 1 if case.endswith("/resume") else rec["steps"]
        with tempfile.TemporaryDirectory() as tmp:
            if case.endswith("/resume"):
                got = _resume_from_commit(case, rec["commit"], steps, Path(tmp))
            else:
                got = _subprocess_case(case, steps, REPO, Path(tmp))
        found = _diff(case, rec["cases"][case], got)
        problems += found
        n += 1
        print(f"{case:32s} {'bitwise equal' if not found else f'{len(found)} differences'}  "
              f"{time.perf_counter() - t0:6.1f} s", flush=True)
    for p in problems[:50]:
        print(p)
    print(f"golden: {n - len({p.split(':')[0] for p in problems})} equal, "
          f"{len({p.split(':')[0] for p in problems})} differ (record {rec['commit'][:10]}, here {_commit()[:10]})")
    return 1 if problems else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--out", type=Path, default=None)
    r.add_argument("--cases", nargs="*", default=None)
    c = sub.add_parser("compare")
    c.add_argument("record", type=Path)
    c.add_argument("--cases", nargs="*", default=None)
    one = sub.add_parser("case")
    one.add_argument("case")
    one.add_argument("--root", type=Path, required=True)
    one.add_argument("--steps", type=int, required=True)
    one.add_argument("--resume-at", type=int, default=None)
    one.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.cmd == "case":
        a.out.write_text(json.dumps(run_case(a.case, a.root, a.steps, a.resume_at)))
        return 0
    if a.cmd == "record":
        out = a.out or REPO / "benchmarks" / "results" / "golden" / f"{_commit()[:10]}.json"
        return record(a.cases or all_cases(), out)
    return compare(a.record, a.cases)


if __name__ == "__main__":
    sys.exit(main())
