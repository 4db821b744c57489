"""Does a recipe's reward (or accuracy) climb? Runs it through ``run_local`` for several seeds, one process per
seed (each single-threaded, side by side), and reports the climb statistics of ``unirl_core.report.climb`` per seed
plus the held-out eval of the starting and the last version (from the run report's ``eval/`` records).

    python benchmarks/first_run_climb.py --recipe shapes-climb --seeds 0 1          # the climb recipe's numbers
    python benchmarks/first_run_climb.py --recipe toy-sums --metric reward/toy_correct/mean --sft sft-toy-sums

``--sft NAME`` first trains that SFT recipe (``--sft-override a.b=value`` changes it; its export is what the RL
recipe's model points at, under the same checkpoint root). ``--jobs 1`` runs the seeds one after another (a shared
machine). Writes cell ``<recipe>[_<tag>]`` of ``benchmarks/results/first_run_climb/latest.{json,md}``
(``--results`` elsewhere).
The climb tests (``tests/integration/test_first_run_learns.py``) call ``measure`` with the same code path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run_seed(recipe: str, seed: int, root: str, overrides: list[str], out: str) -> None:
    """One seed in this process: run_local, then write every step's metrics and the eval records to ``out``."""
    import torch

    torch.set_num_threads(1)
    from unirl_core.config.recipes import load_recipe
    from unirl_core.loop.local import run_local
    from unirl_core.report.run_report import RunReport

    cfg = load_recipe(recipe, [f"checkpoint.root={root}", f"name={recipe}-seed{seed}", f"loop.seed={seed}",
                               "report.tensorboard=false", *overrides])
    t0 = time.perf_counter()
    hist = run_local(cfg, resume_from="never", progress=False)
    seconds = time.perf_counter() - t0
    evals = [rec.__dict__ for rec, _ in RunReport(f"{root}/{cfg.name}").evals()]
    Path(out).write_text(json.dumps({"seed": seed, "seconds": seconds, "history": hist, "evals": evals}))


def train_sft(name: str, root: str, overrides: list[str] = ()) -> float:
    """Train (and export) SFT recipe ``name`` (with ``a.b=value`` overrides) under ``root``; returns its seconds."""
    import torch

    torch.set_num_threads(1)
    from unirl_core.sft.config import load_sft_recipe
    from unirl_core.sft.local import run_sft

    t0 = time.perf_counter()
    run_sft(load_sft_recipe(name, [f"checkpoint.root={root}", *overrides]), resume_from="never", progress=False)
    return time.perf_counter() - t0


def single_thread_env() -> dict[str, str]:
    """The environment of a run's subprocess: one thread, the repo importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def seeds_in_subprocesses(recipe: str, seeds: list[int], root: str, overrides: list[str], jobs: int, timeout: float,
                          *, target: str = "benchmarks.first_run_climb:run_seed") -> dict:
    """``target`` (``module:function``, called as ``f(recipe, seed, root, overrides, out)``, writing its record as
    JSON to ``out``) for every seed, each in its own single-threaded subprocess, ``jobs`` of them at a time;
    returns each seed's record."""
    module, func = target.split(":")
    env = single_thread_env()
    outs = {}
    for i in range(0, len(seeds), jobs):
        procs = []
        for s in seeds[i:i + jobs]:
            out = f"{root}/seed{s}.json"
            code = f"from {module} import {func}; {func}({recipe!r}, {s}, {root!r}, {list(overrides)!r}, {out!r})"
            procs.append((s, out, subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        for s, out, p in procs:
            log, _ = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"seed {s} of {recipe} failed (exit {p.returncode}):\n{log[-4000:]}")
            outs[s] = json.loads(Path(out).read_text())
    return outs


def measure(recipe: str, seeds: list[int], root: str, *, metric: str = "reward/mean", overrides: list[str] = (),
            timeout: float = 7200, jobs: int | None = None) -> dict:
    """Run ``recipe`` for every seed in subprocesses (``jobs`` side by side; None: all seeds at once); per seed its
    ``metric`` curve, climb statistics, failures against the default ``ClimbCriteria``, held-out eval records and
    seconds."""
    from unirl_core.report.climb import climb_stats

    outs = seeds_in_subprocesses(recipe, list(seeds), root, list(overrides), max(1, jobs or len(seeds)), timeout)
    result = {"recipe": recipe, "metric": metric, "overrides": list(overrides), "seeds": {}}
    for s, data in outs.items():
        curve = [h[metric] for h in data["history"]]
        stats = climb_stats(curve)
        result["seeds"][s] = {"curve": curve, "stats": stats.__dict__, "failures": stats.failures(),
                              "summary": stats.summary(), "evals": data["evals"], "seconds": data["seconds"],
                              "step_seconds_median": sorted(h["time/step"] for h in data["history"])[
                                  len(data["history"]) // 2]}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="shapes-climb")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--metric", default="reward/mean")
    ap.add_argument("--sft", default="", help="an SFT recipe to train first (its export under the same root)")
    ap.add_argument("--sft-override", action="append", default=[], help="an a.b=value override of the SFT recipe")
    ap.add_argument("--root", default="runs/first_run_climb", help="checkpoint root of the runs")
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--jobs", type=int, default=0, help="seeds run side by side (0: all at once)")
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--tag", default="", help="suffix of the cell name (<recipe>_<tag>)")
    args = ap.parse_args()
    from benchmarks.common import environment, write_record

    root = str(Path(args.root).resolve())
    os.makedirs(root, exist_ok=True)
    overrides = list(args.override)
    sft_s = None
    if args.sft:
        sft_s = train_sft(args.sft, root, args.sft_override)
        overrides.append(f"lm.model.model={root}/{args.sft}/export")
    res = measure(args.recipe, args.seeds, root, metric=args.metric, overrides=overrides, jobs=args.jobs or None)
    res["sft_seconds"] = sft_s
    res["sft_overrides"] = list(args.sft_override)
    res["env"] = environment()
    eval_key = "eval/reward/mean"
    lines = [f"{args.recipe}, {args.metric} per step ({res['env']['cpu']}, {res['env']['cores']} cores):"]
    for s, r in res["seeds"].items():
        ev = r["evals"]
        held = (f"; held-out {eval_key} step {ev[0]['step']} {ev[0]['metrics'].get(eval_key, float('nan')):.3f} -> "
                f"step {ev[-1]['step']} {ev[-1]['metrics'].get(eval_key, float('nan')):.3f}") if ev else ""
        lines.append(f"seed {s}: {r['summary']}{held}; {r['seconds']:.0f} s ({r['step_seconds_median']:.1f} s/step)"
                     f"; {'CLIMBS' if not r['failures'] else 'FAILS: ' + '; '.join(r['failures'])}")
    print("\n".join(lines))
    res["root"] = "<root>"  # no machine paths in results
    res["overrides"] = [o.replace(root, "<root>") for o in res["overrides"]]
    cell = args.recipe + (f"_{args.tag}" if args.tag else "")
    write_record("first_run_climb", res, "\n\n".join(lines), cell=cell, env=res["env"], results_dir=Path(args.results))


if __name__ == "__main__":
    main()
