"""What a fork saves: a run forked at step k with a changed reward (``checkpoint.fork_from``) against the rerun that
gets the same result without forks - the same recipe trained from scratch to step k, then resumed with the changed
reward to the end - measured in one process, one after the other, for each k.

Per k: wall time of each side (the fork trains steps k+1..N; the rerun trains 1..N), the bytes each adds to the
checkpoint root (the fork: its run folder and its pin in the parent; the rerun: its run folder), their ratios, and
whether the fork's last version equals the rerun's bit for bit (weights and full train state: it must, the fork is
that rerun without its prefix). The parent is trained first (it also pays the process's model build, so neither
side does). Both sides run the shipped path (``run_local``); what the rerun does that the fork does not is the k
prefix steps and their versions.

    python benchmarks/bench_fork.py          # the workflow's default recipe, shrunk (see --overrides), 16 steps
    python benchmarks/bench_fork.py --steps 34 --fork-at 32   # the issue's fork point: step 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import environment, format_table, pin_threads, write_record  # noqa: E402

SHRINK = ["data.samples_per_prompt=4", "eval=null", "report.tensorboard=false"]
"""The default recipe at 16 samples a step instead of 48, without its held-out eval: a 16-step parent and its forks
fit the benchmark's 10 minutes on 2 CPU cores (the recipe's 64 steps at full size take about 10 s a step)."""
OTHER_REWARD = 'reward.components=[{"name": "shapes_count", "weight": 1.0}]'


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def version_bytes(path: Path) -> int:
    return sum(folder_bytes(p) for p in path.glob("step-*"))


def same_last_version(root: str, a: str, b: str, step: int) -> bool:
    from unirl_core.checkpoint import CheckpointStore, load_checkpoint
    from unirl_core.io.diff import same_bits

    x, y = (load_checkpoint(CheckpointStore(root, run).ref_for(step, step)) for run in (a, b))
    return same_bits(x.weights, y.weights) and same_bits(x.train_state, y.train_state)


def measure(recipe: str, overrides: list[str], steps: int, fork_at: list[int]) -> tuple[dict, list[dict]]:
    from unirl_core.config import load_recipe
    from unirl_core.loop.local import run_local

    with tempfile.TemporaryDirectory() as root:
        def cfg(name: str, total: int, *extra: str):
            return load_recipe(recipe, [*overrides, f"checkpoint.root={root}", "checkpoint.keep_every=1",
                                        f"name={name}", f"loop.total_steps={total}", *extra])

        t0 = time.perf_counter()
        hist = run_local(cfg("parent", steps), progress=False)
        parent = {"steps": steps, "wall_s": round(time.perf_counter() - t0, 2),
                  "step_s_median": round(sorted(h["time/step"] for h in hist[1:])[(len(hist) - 1) // 2], 3),
                  "version_mb": round(version_bytes(Path(root) / "parent") / 1e6, 2)}
        rows = []
        for k in fork_at:
            fork, rerun = f"fork-{k}", f"rerun-{k}"
            t0 = time.perf_counter()
            fork_hist = run_local(cfg(fork, steps, f"checkpoint.fork_from=parent@{k}", OTHER_REWARD), progress=False)
            fork_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            run_local(cfg(rerun, k), progress=False)
            rerun_hist = run_local(cfg(rerun, steps, OTHER_REWARD), progress=False)
            rerun_s = time.perf_counter() - t0
            pin = Path(root) / "parent" / "forks" / f"{fork}.json"
            fork_b = folder_bytes(Path(root) / fork) + pin.stat().st_size
            rerun_b = folder_bytes(Path(root) / rerun)
            fork_v = version_bytes(Path(root) / fork) + pin.stat().st_size
            rerun_v = version_bytes(Path(root) / rerun)
            rows.append({
                "fork_at": k, "fork_steps_run": len(fork_hist), "rerun_steps_run": k + len(rerun_hist),
                "fork_s": round(fork_s, 2), "rerun_s": round(rerun_s, 2), "time_ratio": round(fork_s / rerun_s, 3),
                "fork_mb": round(fork_b / 1e6, 3), "rerun_mb": round(rerun_b / 1e6, 3),
                "bytes_ratio": round(fork_b / rerun_b, 3),
                "fork_version_mb": round(fork_v / 1e6, 3), "rerun_version_mb": round(rerun_v / 1e6, 3),
                "start_version_kb": round(folder_bytes(Path(root) / fork / f"step-{k:08d}") / 1e3, 1),
                "same_bits": same_last_version(root, fork, rerun, steps)})
            print(json.dumps(rows[-1]), flush=True)
    return parent, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="shapes-flow-grpo-count")
    ap.add_argument("--overrides", nargs="*", default=SHRINK)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--fork-at", type=int, nargs="+", default=[4, 8, 12])
    ap.add_argument("--cell", default=None, help="the record's cell (default: fork_<k>_..._of_<steps>)")
    args = ap.parse_args()
    pin_threads(1)
    parent, rows = measure(args.recipe, args.overrides, args.steps, args.fork_at)
    keys = ["fork_at", "fork_steps_run", "rerun_steps_run", "fork_s", "rerun_s", "time_ratio", "fork_mb", "rerun_mb",
            "bytes_ratio", "fork_version_mb", "rerun_version_mb", "start_version_kb", "same_bits"]
    md = (f"{args.recipe} with {args.overrides}, keep_every=1; parent {parent['steps']} steps in {parent['wall_s']} s "
          f"(median step {parent['step_s_median']} s, {parent['version_mb']} MB of versions). Per fork point k: the "
          f"fork (checkpoint.fork_from=parent@k, reward changed to shapes_count) against the rerun that reaches the "
          f"same version (k steps from scratch, then resumed with the changed reward); bytes: all the run wrote "
          f"(versions and report) and the versions alone, the fork's pin in the parent included; same_bits: the "
          f"two last versions (weights, train state) are bitwise equal.\n\n"
          + format_table(keys, [[r[k] for k in keys] for r in rows]))
    print(md)
    cell = args.cell or "fork_" + "_".join(str(k) for k in args.fork_at) + f"_of_{args.steps}"
    write_record("bench_fork", {"parent": parent, "forks": rows}, md, env=environment(), cell=cell,
                 headline=", ".join(f"fork at {r['fork_at']}/{args.steps}: x{r['time_ratio']} time, "
                                    f"x{r['bytes_ratio']} bytes" for r in rows))


if __name__ == "__main__":
    main()
