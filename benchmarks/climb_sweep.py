"""Many climb runs side by side within a time budget (a hyperparameter sweep for ``first_run_climb.py``'s bar).

Each run is ``recipe [overrides]`` for one seed through ``run_local`` (a composed recipe such as
``shapes-enhance-joint``: ``run_compose_local``, also recording the enhancer's reward and greedy evaluations) in its
own single-threaded process; every step's metric is appended to a file as it lands, so a run the budget cuts still
reports the steps it trained.

    python benchmarks/climb_sweep.py --budget 480 --seeds 0 1 \
        --run "shapes-flow-grpo-climb" --run "shapes-flow-grpo-climb train.lr=2e-4"

Prints one row per run (thirds, z, Spearman, climbs: ``unirl_core.report.climb``) and writes them as JSON
as cell ``--cell`` of ``benchmarks/results/climb_sweep/latest.{json,md}`` (``--no-record``: print only).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


EXTRA = ("enhancer/reward/mean", "eval/reward/mean", "eval/copy_reward/mean")
"""Metrics a composed run also records per step when present (the enhancer's reward, its greedy evaluation)."""


def run_one(recipe: str, seed: int, root: str, overrides: list[str], out: str, metric: str) -> None:
    """One run in this process, appending ``{"step", metric, "time/step"}`` per step to ``out`` (JSON lines).
    A composed recipe (``unirl_core.compose``: prompt enhancer + image model) runs through ``run_compose_local``."""
    import torch

    torch.set_num_threads(1)
    from unirl_core.compose import compose_recipe_names, load_compose_recipe
    from unirl_core.compose.local import run_compose_local
    from unirl_core.config.recipes import load_recipe
    from unirl_core.loop.local import run_local

    over = [f"checkpoint.root={root}", f"loop.seed={seed}", "report.tensorboard=false", *overrides]

    def on_step(metrics: dict, _batch) -> None:
        row = {"step": metrics.get("step"), metric: metrics.get(metric), "time/step": metrics.get("time/step"),
               **{k: metrics[k] for k in EXTRA if k in metrics}}
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")

    if recipe in compose_recipe_names():
        run_compose_local(load_compose_recipe(recipe, over), resume_from="never", on_step=on_step, progress=False)
    else:
        run_local(load_recipe(recipe, over), resume_from="never", on_step=on_step, progress=False)


def main() -> None:
    from benchmarks.first_run_climb import single_thread_env
    from unirl_core.report.climb import climb_stats

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help='"recipe a.b=v c.d=w" (repeatable)')
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--metric", default="reward/mean")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; runs still going then are stopped")
    ap.add_argument("--root", default="runs/climb_sweep")
    ap.add_argument("--cell", default="sweep", help="cell of results/climb_sweep/latest.json these runs replace")
    ap.add_argument("--no-record", action="store_true", help="print only, write no record")
    args = ap.parse_args()
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    env = single_thread_env()
    procs = []
    for i, spec in enumerate(args.run):
        recipe, *overrides = shlex.split(spec)
        for seed in args.seeds:
            name = f"r{i}-s{seed}"
            out = root / f"{name}.jsonl"
            out.unlink(missing_ok=True)
            shutil.rmtree(root / name, ignore_errors=True)  # an earlier sweep's run of the same name under this root
            code = (f"from benchmarks.climb_sweep import run_one; run_one({recipe!r}, {seed}, {str(root)!r}, "
                    f"{[*overrides, f'name={name}']!r}, {str(out)!r}, {args.metric!r})")
            log = open(root / f"{name}.log", "w")
            procs.append((spec, seed, name, out, log, subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                                                                stdout=log, stderr=subprocess.STDOUT)))
    t0 = time.perf_counter()
    while any(p.poll() is None for *_, p in procs) and time.perf_counter() - t0 < args.budget:
        time.sleep(2)
    rows = []
    for spec, seed, name, out, log, p in procs:
        cut = p.poll() is None
        if cut:
            p.kill()
            p.wait()
        log.close()
        lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
        curve = [x[args.metric] for x in lines]
        row = {"run": spec, "seed": seed, "steps": len(curve), "cut": cut, "exit": p.returncode, "curve": curve,
               "step_seconds_median": sorted(x["time/step"] for x in lines)[len(lines) // 2] if lines else None}
        if len(curve) >= 9:
            st = climb_stats(curve)
            row.update(thirds=[round(v, 3) for v in st.thirds], z=round(st.z, 2), rho=round(st.spearman, 2),
                       climbs=not st.failures())
            enhancer = [x["enhancer/reward/mean"] for x in lines if "enhancer/reward/mean" in x]
            if len(enhancer) >= 9:
                se = climb_stats(enhancer)
                row["enhancer"] = {"thirds": [round(v, 3) for v in se.thirds], "z": round(se.z, 2)}
        evals = [(x["step"], round(x["eval/reward/mean"], 3), round(x.get("eval/copy_reward/mean", float("nan")), 3))
                 for x in lines if "eval/reward/mean" in x]
        if evals:
            row["evals"] = evals  # (step, greedy eval, copy baseline) of a composed run; step 0's is not a step
        if p.returncode not in (0, None) and not cut:
            row["error"] = (root / f"{name}.log").read_text()[-1500:]
        rows.append(row)
        print(f"{spec} | seed {seed} | {len(curve)} steps{' (cut)' if cut else ''} | thirds "
              f"{' / '.join(f'{v:.3f}' for v in row.get('thirds', []))} | z {row.get('z')} | rho {row.get('rho')} | "
              f"{'CLIMBS' if row.get('climbs') else 'no'}"
              + (f" | enhancer thirds {row['enhancer']['thirds']} z {row['enhancer']['z']}"
                 if "enhancer" in row else "")
              + (f" | evals {row['evals']}" if "evals" in row else "")
              + (f" | ERROR {row['error'][-300:]}" if 'error' in row
                                                              else ""), flush=True)
    if not args.no_record:
        md = "| run | seed | steps | thirds | z | rho | climbs |\n|---|---|---|---|---|---|---|\n" + "".join(
            f"| {r['run']} | {r['seed']} | {r['steps']}{' (cut)' if r['cut'] else ''} | "
            f"{' / '.join(f'{v:.3f}' for v in r.get('thirds', []))} | {r.get('z')} | {r.get('rho')} | "
            f"{'yes' if r.get('climbs') else 'no'} |\n" for r in rows)
        from benchmarks.common import write_record

        print(f"wrote {write_record('climb_sweep', rows, md, cell=args.cell)}")


if __name__ == "__main__":
    main()
