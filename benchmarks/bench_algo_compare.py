"""Compute-matched comparison of the shipped diffusion algorithms on the shapes world.

Every algorithm trains the shipped shapes-world model (``shapes-sd3``, the same warm start) on one curriculum
(shapes-count-climb's 4 one-group circle captions, every caption every step, 4 x 8 images) with the algorithm
settings of its shipped recipe, until a budget of **process CPU time** (``time.process_time`` of the training
process, one thread: wall clock on a shared machine measures the neighbours too), for several seeds each:

- ``flow_grpo``: ``shapes-flow-grpo-count`` (Flow-GRPO-Fast: a 3-step SDE window starting at step 0 or 1, KL 0.04).
- ``mixgrpo``: the same with MixGRPO's sliding window (4 SDE steps, moving one step towards the clean end every
  ``--mix-interval`` training steps, only the window trained).
- ``grpo_guard``: ``shapes-flow-grpo-count`` with ``algorithm.name: grpo_guard`` (RatioNorm + step reweighting).
- ``flow_dppo``: ``shapes-flow-grpo-count`` with ``algorithm.name: flow_dppo`` (KL trust region 1e-4, replayed pi_old).
- ``nft``: ``shapes-count-climb`` (DiffusionNFT, EMA sampling policy).
- ``elbo_pg``: ``shapes-elbo-pg`` (ELBO policy gradient).

The budget clock starts when ``run_local`` is called (so it includes each run's model build, a few seconds for
every algorithm) and the run stops after the first step that leaves less than half a step of budget (the steps
reached and the CPU actually spent are recorded). Each cell runs in its own single-threaded subprocess, one at a
time. After training (outside the budget): the held-out eval (the recipes' 16 unseen captions x 2 fixed-noise ODE
images, ``eval/reward/mean``) of the starting and the final version, and the hacking check: the first and the last
training batch (``checkpoint.keep_batches``) re-scored by ``unirl_core.runs.rescore`` with a held-out constraint,
the same compositional reward under a strict detector (``STRICT``: shapes must match their template closely and
be of a pure palette colour). A run whose training reward rises while the strict score of the same images falls
is flagged.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_algo_compare.py                 # 6 algos x 3 seeds x 70 s
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_algo_compare.py --algos nft elbo_pg --seeds 0 --budget 30

Writes ``benchmarks/results/algo_compare/latest.{json,md}`` and the chart ``docs/img/algo_compare.svg``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CURRICULUM = ["two red circles", "two blue circles", "three yellow circles", "a yellow circle"]
"""shapes-count-climb's curriculum (shapes-elbo-pg's too): captions the warm start gets right some of the time."""
STRICT = {"min_iou": 0.8, "max_color_distance": 45.0}
"""The held-out constraint's detector (defaults: min_iou 0.6, max_color_distance 90)."""
ALGOS: dict[str, tuple[str, dict]] = {
    "flow_grpo": ("shapes-flow-grpo-count", {}),
    "mixgrpo": ("shapes-flow-grpo-count", {"sampling": {"sde_window_size": 4, "sde_window_range": None,
                                                        "sde_window_stride": 1}}),
    "grpo_guard": ("shapes-flow-grpo-count", {"algorithm": {"name": "grpo_guard"}}),
    "flow_dppo": ("shapes-flow-grpo-count", {"algorithm": {"name": "flow_dppo", "clip_range": None,
                                                           "old_logp_source": "replay"},
                                             "train": {"old_logp_source": "replay"}}),
    "nft": ("shapes-count-climb", {}),
    "elbo_pg": ("shapes-elbo-pg", {}),
}
MAX_STEPS = 200
"""loop.total_steps of every run: far beyond any budget here (the budget stops it)."""


class BudgetReached(Exception):
    """Raised from the step callback to end a run at its CPU budget (the step's version is published first)."""


def run_config(algo: str, seed: int, root: str, mix_interval: int):
    """The cell's RunConfig: the algorithm's shipped recipe on the common curriculum, batch and eval."""
    from unirl_core.config.loader import from_dict
    from unirl_core.config.recipes import load_recipe_dict
    from unirl_core.config.run import RunConfig

    recipe, changes = ALGOS[algo]
    data = load_recipe_dict(recipe)
    diff = data["diffusion"]
    for section in ("sampling", "algorithm"):
        for key, value in changes.get(section, {}).items():
            if value is None:
                diff[section].pop(key, None)
            else:
                diff[section][key] = value
    if algo == "mixgrpo":
        diff["sampling"]["sde_window_shift_interval"] = mix_interval
    data["train"].update(changes.get("train", {}))
    data.update(name=f"{algo}-seed{seed}")
    data["data"].update(source="inline", prompts=list(CURRICULUM), prompts_per_step=4, samples_per_prompt=8)
    data["data"].pop("shapes", None)
    data["loop"].update(total_steps=MAX_STEPS, seed=seed)
    # evaluated after the budget, outside it: not at step 0, and the run's end (MAX_STEPS) is never reached
    data["eval"].update(at_start=False, at_end=True, every_n_steps=0)
    data["checkpoint"] = {"root": root, "keep_batches": True, "keep_every": MAX_STEPS * 10}  # keeps step 0
    data.setdefault("report", {})["tensorboard"] = False
    return from_dict(RunConfig, data, "recipe")


def run_cell(algo: str, seed: int, root: str, budget: float, mix_interval: int, out: str,
             start_eval: bool = True) -> None:
    """One (algorithm, seed) in this process: train to the CPU budget, evaluate (the starting version too when
    ``start_eval``: the eval's noise is fixed, so it is the same for every seed), re-score; JSON to ``out``."""
    import torch

    torch.set_num_threads(1)
    from unirl_core.checkpoint import CheckpointStore
    from unirl_core.loop.evaluate import eval_phase
    from unirl_core.loop.local import run_local
    from unirl_core.runs.rescore import alternative, rescore

    cfg = run_config(algo, seed, root, mix_interval)
    curve: list[dict] = []
    t0 = time.process_time()

    def on_step(metrics: dict, _batch) -> None:
        used = time.process_time() - t0
        curve.append({"step": int(metrics["step"]), "cpu_s": used, "reward": metrics["reward/mean"],
                      "wall_s": metrics["time/step"]})
        if used + 0.5 * used / len(curve) >= budget:
            raise BudgetReached

    try:
        run_local(cfg, resume_from="never", on_step=on_step, progress=False)
    except BudgetReached:
        pass
    else:
        raise RuntimeError(f"{algo} seed {seed}: {MAX_STEPS} steps inside a {budget} s budget; raise MAX_STEPS")
    store = CheckpointStore(root, cfg.name)
    versions = {v.step: v for v in store.versions()}
    last = store.latest()
    evals = {}
    for which, ref in ((("start", versions[0]),) if start_eval else ()) + (("end", last),):
        _, m = eval_phase(cfg, ref)
        evals[which] = m["eval/reward/mean"]
    strict = alternative("shapes_compositional", name="strict", kwargs=dict(STRICT))
    table = rescore(f"{root}/{cfg.name}", [strict], steps=[1, last.step], write=False)
    rows = {r.step: {"train": r.run, "strict": r.means["strict"], "corr": r.correlations["strict"]}
            for r in table.rows}
    Path(out).write_text(json.dumps({"algo": algo, "seed": seed, "budget_cpu_s": budget, "curve": curve,
                                     "steps": last.step, "cpu_s": curve[-1]["cpu_s"], "eval": evals,
                                     "rescore": {"first": rows[1], "last": rows[last.step]}}))


def git_commit() -> str:
    """The commit this cell ran at (``+dirty`` with uncommitted changes)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def summarize(cell: dict) -> dict:
    """The table's numbers for one cell."""
    rewards = [c["reward"] for c in cell["curve"]]
    first, last = cell["rescore"]["first"], cell["rescore"]["last"]
    d_train, d_strict = last["train"] - first["train"], last["strict"] - first["strict"]
    return {"algo": cell["algo"], "seed": cell["seed"], "steps": cell["steps"], "cpu_s": cell["cpu_s"],
            "train_first": statistics.fmean(rewards[:3]), "train_final": statistics.fmean(rewards[-3:]),
            "eval_start": cell["eval"]["start"], "eval_end": cell["eval"]["end"],
            "d_train": d_train, "d_strict": d_strict, "hacking": d_train > 0 and d_strict < 0}


def chart(cells: list[dict], path: Path) -> None:
    """Training reward (mean over seeds, per step at its mean CPU time) and held-out eval (start, end) against
    CPU minutes, one colour per algorithm; an SVG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "algo_compare"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, algo in enumerate(dict.fromkeys(c["algo"] for c in cells)):
        runs = [c for c in cells if c["algo"] == algo]
        n = min(len(r["curve"]) for r in runs)
        x = [statistics.fmean(r["curve"][k]["cpu_s"] for r in runs) / 60 for k in range(n)]
        y = [statistics.fmean(r["curve"][k]["reward"] for r in runs) for k in range(n)]
        color = f"C{i}"
        left.plot(x, y, color=color, label=algo, lw=1.4)
        end_x = statistics.fmean(r["cpu_s"] for r in runs) / 60
        ys = [r["eval"]["end"] for r in runs]
        right.errorbar([0, end_x], [runs[0]["eval"]["start"], statistics.fmean(ys)],
                       yerr=[0, statistics.pstdev(ys)], color=color, marker="o", capsize=3, label=algo, lw=1.2)
    left.set(xlabel="training-process CPU minutes", ylabel="training reward (mean of seeds)",
             title="training reward")
    right.set(xlabel="training-process CPU minutes", ylabel="held-out eval/reward/mean",
              title="held-out eval: start -> end (mean, std of seeds)")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=path.suffix[1:] or "svg", metadata={"Date": None} if path.suffix != ".png" else None)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--budget", type=float, default=70.0, help="training-process CPU seconds per run")
    ap.add_argument("--mix-interval", type=int, default=2, help="MixGRPO: training steps between window moves")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the record's cells of the algorithms not run now (each cell names its commit)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="cells run side by side (each its own single-threaded process; the budget is CPU time)")
    ap.add_argument("--work", default="", help="folder of the runs and per-cell results (default: a temp folder); "
                                               "a cell whose result is there already is not run again")
    ap.add_argument("--collect-only", action="store_true", help="only tabulate the cells found in --work")
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--chart", default=str(REPO / "docs" / "img" / "algo_compare.svg"))
    args = ap.parse_args()
    from benchmarks.common import environment, format_table, write_record
    from benchmarks.first_run_climb import single_thread_env

    env = single_thread_env()
    cells = []
    record = Path(args.results) / "algo_compare" / "latest.json"
    if args.reuse and record.exists():
        cells = [c for c in json.loads(record.read_text())["results"]["cells"] if c["algo"] not in args.algos]
        if other := {c["budget_cpu_s"] for c in cells} - {args.budget}:
            raise SystemExit(f"--reuse: the record's cells ran at a budget of {sorted(other)} CPU s, not "
                             f"--budget {args.budget}: run every algorithm again or pass that budget")
    order = list(dict.fromkeys([*(c["algo"] for c in cells), *args.algos]))
    work = Path(args.work or tempfile.mkdtemp(prefix="algo_compare-"))
    work.mkdir(parents=True, exist_ok=True)
    todo = [(a, s) for a in args.algos for s in args.seeds]
    running: list[tuple[str, int, Path, subprocess.Popen, float]] = []
    while todo or running:
        while todo and len(running) < args.jobs and not args.collect_only:
            algo, seed = todo.pop(0)
            out = work / f"{algo}-{seed}.json"
            if out.exists():  # measured by an earlier, interrupted invocation with this --work
                continue
            code = (f"from benchmarks.bench_algo_compare import run_cell; run_cell({algo!r}, {seed}, "
                    f"{str(work / 'runs')!r}, {args.budget}, {args.mix_interval}, {str(out)!r}, "
                    f"{seed == args.seeds[0]})")
            with open(work / f"{algo}-{seed}.log", "w") as log:
                running.append((algo, seed, out, subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                                                                  stdout=log, stderr=subprocess.STDOUT),
                                time.perf_counter()))
        if args.collect_only:
            break
        time.sleep(2)
        for item in [r for r in running if r[3].poll() is not None]:
            algo, seed, out, p, t0 = item
            running.remove(item)
            if p.returncode != 0:
                tail = (work / f"{algo}-{seed}.log").read_text()[-4000:]
                raise RuntimeError(f"{algo} seed {seed} failed (exit {p.returncode}):\n{tail}")
            cell = {**json.loads(out.read_text()), "commit": git_commit()}
            out.write_text(json.dumps(cell))
            rewards = [c["reward"] for c in cell["curve"]]  # the start eval may sit in another seed's cell
            print(f"{algo} seed {seed}: {cell['steps']} steps in {cell['cpu_s']:.0f} CPU s "
                  f"({time.perf_counter() - t0:.0f} s wall with evals); train {statistics.fmean(rewards[:3]):.3f} -> "
                  f"{statistics.fmean(rewards[-3:]):.3f}, eval -> {cell['eval']['end']:.3f}", flush=True)
    done = [json.loads((work / f"{a}-{s}.json").read_text()) for a in args.algos for s in args.seeds
            if (work / f"{a}-{s}.json").exists()]
    for cell in done:
        cell.setdefault("commit", git_commit())  # a cell whose launching invocation was stopped before it ended
        if "start" not in cell["eval"]:
            cell["eval"]["start"] = next(c["eval"]["start"] for c in done if c["algo"] == cell["algo"]
                                         and "start" in c["eval"])
    cells.extend(done)
    rows, summary = [], []
    header = ["algorithm", "seed", "budget CPU s", "CPU s used", "steps", "train reward first 3 -> last 3",
              "held-out eval start -> end", "change of train / strict score, step 1 -> last batch", "hacking?"]
    for algo in order:
        mine = [summarize(c) for c in cells if c["algo"] == algo]
        summary.extend(mine)
        for s in mine:
            rows.append([algo, s["seed"], f"{args.budget:.0f}", f"{s['cpu_s']:.0f}", s["steps"],
                         f"{s['train_first']:.3f} -> {s['train_final']:.3f}",
                         f"{s['eval_start']:.3f} -> {s['eval_end']:.3f}",
                         f"{s['d_train']:+.3f} / {s['d_strict']:+.3f}", "strict down" if s["hacking"] else "no"])
        mean = lambda k: statistics.fmean(s[k] for s in mine)  # noqa: E731
        rows.append([f"**{algo} mean**", "", f"{args.budget:.0f}", f"{mean('cpu_s'):.0f}", f"{mean('steps'):.1f}",
                     f"{mean('train_first'):.3f} -> {mean('train_final'):.3f}",
                     f"{mean('eval_start'):.3f} -> {mean('eval_end'):.3f}",
                     f"{mean('d_train'):+.3f} / {mean('d_strict'):+.3f}",
                     "FLAG" if mean("d_train") > 0 > mean("d_strict") else "no"])
    table = format_table(header, rows)
    lines = [f"Compute-matched shapes-world comparison: {args.budget:.0f} s of training-process CPU time "
             f"(time.process_time, 1 thread) per run, from shapes-sd3, curriculum {CURRICULUM}, 4 x 8 images a "
             f"step, seeds {sorted({c['seed'] for c in cells})}; hacking check: the first and last training batch re-scored with the "
             f"compositional reward under a strict detector {STRICT}; a seed whose training reward rose while the strict score "
             f"of the same images fell says 'strict down', an algorithm whose seed means do says FLAG.",
             table]
    print("\n\n".join(lines))
    chart_path = Path(args.chart)
    chart(cells, chart_path)
    env_rec = environment()
    write_record("algo_compare", {"budget_cpu_s": args.budget, "budget_clock": "time.process_time",
                                  "seeds": sorted({c["seed"] for c in cells}), "curriculum": CURRICULUM, "strict": STRICT,
                                  "mix_interval": args.mix_interval, "cells": cells, "summary": summary,
                                  "chart": chart_path.relative_to(REPO).as_posix() if chart_path.is_relative_to(REPO)
                                  else chart_path.name},
                 "\n\n".join(lines), env=env_rec, results_dir=Path(args.results),
                 description="Shipped diffusion algorithms trained to the same training-process CPU budget on the "
                             "shapes world: training reward, held-out eval and a strict-detector re-score.")


if __name__ == "__main__":
    main()
