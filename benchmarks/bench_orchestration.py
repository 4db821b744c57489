"""Orchestration overhead of a local flytekit run of the grpo workflow vs the same phases in plain Python.

Per recipe, in one process (models built once, so neither side pays for construction):
  * baseline: ``run_local`` - the phase functions chained in Python; its ``time/<phase>`` is phase compute;
  * flyte:    ``workflows.grpo.grpo`` executed locally by flytekit (Arrow IPC files between tasks, content
              hashes, decks, the run report, the @dynamic chunks); phase compute is the ``time/<phase>`` the
              tasks record around the same library calls.
Reported: wall / phase compute for both (target for flyte <= 1.15), flyte wall / baseline wall, and the
overhead per task execution in ms. Rounds alternate baseline and flyte; medians are reported. Each round
uses a fresh run name, so the flytekit cache never hits.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_orchestration [--steps 6] [--rounds 3] [--recipes tiny-grpo]
    OMP_NUM_THREADS=1 python -m benchmarks.bench_orchestration --execution pool --pool-override pool.placement=shared

``--execution pool``: the same comparison with ``pool.execution: pool`` at steady state (a local Ray head started
once by this process; its start and each run's actor start are reported apart, not in the per-step times):
  * plain: ``run_local`` in-process (the warm loop), the steps after the warm-up ones;
  * plain-pool: ``run_local`` in pool mode, the same steps;
  * flyte-pool: ``grpo`` in pool mode, one execution of ``--warmup`` steps (``max_steps``: starts the actors), then
    one of ``--steps`` steps on the same config (same actors, warm).
Every side's steady step is timed the same way: from the first measured step's end to the last one's, over the
steps between (run_local: an ``on_step`` clock after its per-step bookkeeping; Flyte: each step's report record,
written by the step's last task, holds its end time). The Flyte execution's once-per-run tasks (setup, init and
resume, the end) fall outside; its wall / steps, with them, is reported beside (``execution_s_per_step``).
Per-phase seconds per step come from the steps' ``time/<phase>`` (Flyte: recorded by each task around the library
call); Flyte's remainder (task machinery, Arrow IPC + hashing, decks, report) is its overhead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import pin_threads, report

TASKS_PER_STEP = 6  # rollout (1 shard: one task, no map + join), reward, advantage, train, publish, report


def _overrides(root: str, name: str, steps: int, chunk: int) -> list[str]:
    return [f"checkpoint.root={root}", f"name={name}", f"loop.total_steps={steps}", f"loop.steps_per_chunk={chunk}"]


def _baseline(recipe: str, root: str, steps: int, chunk: int) -> tuple[float, float]:
    from unirl_core.config import load_recipe
    from unirl_core.loop.local import run_local

    cfg = load_recipe(recipe, _overrides(root, f"b-{uuid.uuid4().hex[:8]}", steps, chunk))
    t0 = time.perf_counter()
    history = run_local(cfg)
    wall = time.perf_counter() - t0
    compute = sum(v for m in history for k, v in m.items() if k.startswith("time/") and k != "time/step")
    return wall, compute


def _flyte(recipe: str, root: str, steps: int, chunk: int) -> tuple[float, float]:
    from workflows.grpo import grpo

    name = f"f-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    grpo(recipe=recipe, overrides=_overrides(root, name, steps, chunk))
    wall = time.perf_counter() - t0
    compute = 0.0
    for path in sorted((Path(root) / name / "report").glob("step-*/metrics.json")):
        compute += sum(v for k, v in json.loads(path.read_text())["metrics"].items() if k.startswith("time/"))
    # init_run (step-0 version) runs in both; it is timed inside init_task but not recorded in the report,
    # so it is left out of the flyte compute and counted as overhead (a conservative choice)
    return wall, compute


PHASES = ("rollout", "reward", "advantage", "train", "publish")


def _phase_means(records: list[dict]) -> dict[str, float]:
    return {p: statistics.mean(r.get(f"time/{p}", 0.0) for r in records) for p in PHASES}


def _pool_plain(recipe: str, root: str, warmup: int, steps: int, pool: bool, pool_extra: list[str] = ()) -> dict:
    from unirl_core.config import load_recipe
    from unirl_core.loop.local import run_local

    extra = ["pool.execution=pool", *pool_extra] if pool else []
    cfg = load_recipe(recipe, [*_overrides(root, f"p-{uuid.uuid4().hex[:8]}", warmup + steps, warmup + steps), *extra])
    ends: list[float] = []  # wall clock at each step's end, after the loop's own per-step bookkeeping
    t0 = time.perf_counter()
    hist = run_local(cfg, progress=False, on_step=lambda metrics, batch: ends.append(time.perf_counter()))
    steady = hist[warmup:]
    return {"step_s": _between_ends(ends[warmup:]), "compute_s": sum(h["time/step"] for h in steady) / steps,
            "first_s": ends[warmup] - t0,  # set-up (actors in pool mode) + the warm-up steps + the first measured
            "phases": _phase_means(steady)}


def _between_ends(ends: list[float]) -> float:
    """Steady seconds per step: from the first measured step's end to the last one's, over the steps between."""
    if len(ends) < 2:
        raise ValueError(f"--steps must be at least 2 to time steps between their ends, got {len(ends)}")
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def _pool_flyte(recipe: str, root: str, warmup: int, steps: int, pool_extra: list[str] = ()) -> dict:
    from workflows.grpo import grpo

    name = f"f-{uuid.uuid4().hex[:8]}"
    overrides = [*_overrides(root, name, warmup + steps, 3), "pool.execution=pool", *pool_extra]
    t0 = time.perf_counter()
    grpo(recipe=recipe, overrides=overrides, max_steps=warmup)  # starts the actors (a new config: a new pool)
    t1 = time.perf_counter()
    out = grpo(recipe=recipe, overrides=overrides, max_steps=steps)  # the same config: the same, warm actors
    wall = time.perf_counter() - t1
    if out.step != warmup + steps:
        raise RuntimeError(f"flyte-pool ran to step {out.step}, expected {warmup + steps}")
    recs = [json.loads(path.read_text())
            for path in sorted((Path(root) / name / "report").glob("step-*/metrics.json"))[warmup:]]
    # steady state as for run_local: between the measured steps' ends (each step's report record, written by the
    # step's last task, holds its end time); the execution's once-per-run tasks (setup, init, resume, the end)
    # are wall / steps - this, reported apart
    return {"step_s": _between_ends([r["time"] for r in recs]), "execution_s_per_step": wall / steps,
            "first_s": t1 - t0, "phases": _phase_means([r["metrics"] for r in recs])}


def _ratio_exec(runs: dict) -> float:
    """Median over rounds of the flyte-pool execution's wall / steps over plain's steady step."""
    return statistics.median(f["execution_s_per_step"] / p["step_s"] for f, p in zip(runs["flyte-pool"], runs["plain"]))


def pool_main(args) -> None:
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps}: pool mode times steps between their ends; use --steps 2 or more")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only, as the pool's own head
    import ray

    t0 = time.perf_counter()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - t0
    rows, data = [], {"ray_head_start_s": ray_start}
    with tempfile.TemporaryDirectory() as root:
        for recipe in args.recipes:
            _pool_plain(recipe, root, 1, 2, False)  # warm-up: imports, the in-process model caches
            runs = {"plain": [], "plain-pool": [], "flyte-pool": []}
            for _ in range(args.rounds):  # alternating, so load drifts hit every side alike
                runs["plain"].append(_pool_plain(recipe, root, args.warmup, args.steps, False))
                runs["plain-pool"].append(_pool_plain(recipe, root, args.warmup, args.steps, True, args.pool_override))
                runs["flyte-pool"].append(_pool_flyte(recipe, root, args.warmup, args.steps, args.pool_override))
            med = {side: statistics.median(r["step_s"] for r in rs) for side, rs in runs.items()}
            ratio = lambda a, b: statistics.median(x["step_s"] / y["step_s"] for x, y in zip(runs[a], runs[b]))  # noqa: E731
            phases = {side: {p: statistics.median(r["phases"][p] for r in rs) for p in PHASES}
                      for side, rs in runs.items()}
            flyte_overhead = med["flyte-pool"] - sum(phases["flyte-pool"].values())
            per_execution = statistics.median(r["execution_s_per_step"] for r in runs["flyte-pool"])
            plain_compute = statistics.median(r["compute_s"] for r in runs["plain"])
            data[recipe] = {"warmup_steps": args.warmup, "steps": args.steps, "rounds": args.rounds,
                            "pool_overrides": list(args.pool_override),
                            "step_s": med, "flyte_pool_vs_plain": ratio("flyte-pool", "plain"),
                            "plain_pool_vs_plain": ratio("plain-pool", "plain"),
                            "flyte_pool_vs_plain_pool": ratio("flyte-pool", "plain-pool"),
                            "phase_s_per_step": phases, "flyte_overhead_s_per_step": flyte_overhead,
                            "flyte_pool_execution_s_per_step": per_execution,
                            "flyte_pool_execution_vs_plain": _ratio_exec(runs),
                            "plain_time_step_s": plain_compute,
                            "first_s": {side: statistics.median(r["first_s"] for r in rs) for side, rs in runs.items()},
                            "target_flyte_pool_vs_plain": 1.15, "raw": runs}
            cell = lambda side: " / ".join(f"{phases[side][p]:.3f}" for p in PHASES)  # noqa: E731
            rows.append([recipe, f"{med['plain']:.3f}", f"{med['plain-pool']:.3f}", f"{med['flyte-pool']:.3f}",
                         f"{data[recipe]['flyte_pool_vs_plain']:.2f}", f"{data[recipe]['plain_pool_vs_plain']:.2f}",
                         cell("plain"), cell("plain-pool"), cell("flyte-pool"), f"{flyte_overhead:.3f}",
                         f"{per_execution:.3f} ({data[recipe]['flyte_pool_execution_vs_plain']:.2f}x)",
                         f"{data[recipe]['first_s']['flyte-pool']:.1f}"])
    header = ["recipe", "plain s/step", "plain-pool s/step", "flyte-pool s/step", "flyte-pool/plain",
              "plain-pool/plain", "plain phases s", "plain-pool phases s", "flyte-pool phases s",
              "flyte overhead s/step", "flyte-pool execution wall / steps s (vs plain)", "flyte-pool first execution s"]
    notes = (f"Steady state, {args.steps} steps after {args.warmup} warm-up step(s), medians over {args.rounds} "
             "alternating rounds (ratios: median of per-round ratios). s/step: from the first measured step's end "
             "to the last one's, over the steps between, on every side (run_local: after its per-step bookkeeping; "
             "Flyte: the end time each step's report record holds); the Flyte execution's once-per-run tasks "
             "(setup, init/resume, the end) are in 'execution wall / steps' instead. "
             f"Phases: {' / '.join(PHASES)} seconds per step "
             "inside the phase functions (pool: the driver's wait on the actor call, so it includes Ray's call and "
             "(de)serialisation). Flyte overhead = flyte-pool step - its phases (task machinery, Arrow IPC + sha256, "
             "decks, report; setup + init tasks once per execution). One-off, not in the steps: Ray head start "
             f"{ray_start:.1f} s; 'first execution' = actor start + the warm-up step(s) through flytekit. "
             "Engine and trainer actors reserve one CPU each on a 2-core machine shared with other jobs; "
             "OMP_NUM_THREADS=1." + (f" Pool overrides on both pool sides: {' '.join(args.pool_override)}."
                                     if args.pool_override else ""))
    suffix = "".join("_" + o.split("=")[-1] for o in args.pool_override)
    report("orchestration", "Local Flyte run in pool mode vs run_local, steady state", header, rows,
           data, notes, cell="pool" + suffix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["tiny-flow-grpo", "tiny-grpo"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=3, help="loop.steps_per_chunk (>1 chunk exercises chaining)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--execution", choices=["pods", "pool"], default="pods")
    ap.add_argument("--warmup", type=int, default=2, help="pool: steps before the measured ones")
    ap.add_argument("--pool-override", action="append", default=[],
                    help="pool: an extra override for both pool sides, e.g. pool.placement=shared (repeatable; the "
                         "results file is named after the values)")
    args = ap.parse_args()
    pin_threads(1)
    logging.getLogger("unirl.progress").disabled = True
    if args.execution == "pool":
        pool_main(args)
        return
    rows, data = [], {}
    with tempfile.TemporaryDirectory() as root:
        for recipe in args.recipes:
            _baseline(recipe, root, 1, 1)  # warm-up: build the models, fill import caches
            _flyte(recipe, root, 1, 1)
            base, flyte = [], []
            for _ in range(args.rounds):
                base.append(_baseline(recipe, root, args.steps, args.chunk))
                flyte.append(_flyte(recipe, root, args.steps, args.chunk))
            # per-round ratios, then the median: on a shared box the load moves between rounds, and a
            # ratio of the same round's wall and compute cancels most of it
            base_ratio = statistics.median(w / c for w, c in base)
            flyte_ratio = statistics.median(w / c for w, c in flyte)
            vs_plain = statistics.median(f[0] / b[0] for f, b in zip(flyte, base))
            tasks = args.steps * TASKS_PER_STEP + 2 + -(-args.steps // args.chunk)  # + setup, init, chunks
            per_task_ms = statistics.median((w - c) / tasks * 1e3 for w, c in flyte)
            bw = statistics.median(w for w, _ in base)
            fw = statistics.median(w for w, _ in flyte)
            data[recipe] = {"steps": args.steps, "chunk": args.chunk, "rounds": args.rounds,
                            "baseline_step_s": bw / args.steps, "flyte_step_s": fw / args.steps,
                            "baseline_ratio": base_ratio, "flyte_ratio": flyte_ratio,
                            "flyte_vs_baseline_wall": vs_plain, "task_executions": tasks,
                            "overhead_per_task_ms": per_task_ms, "target_flyte_ratio": 1.15,
                            "raw_rounds_wall_compute_s": {"baseline": base, "flyte": flyte}}
            rows.append([recipe, args.steps, f"{bw / args.steps:.2f} s", f"{base_ratio:.3f}",
                         f"{fw / args.steps:.2f} s", f"{flyte_ratio:.3f}", f"{vs_plain:.3f}", tasks,
                         f"{per_task_ms:.0f} ms"])
    header = ["recipe", "steps", "plain step", "plain wall/compute", "flyte step", "flyte wall/compute",
              "flyte/plain wall", "task runs", "overhead/task"]
    notes = (f"Local flytekit execution of `workflows/grpo.py::grpo` vs `unirl_core.loop.run_local` (same phase "
             f"functions in plain Python), {args.steps} steps, {args.chunk} steps per @dynamic chunk, medians of "
             f"per-round ratios over {args.rounds} alternating rounds after a warm-up; compute = time inside the "
             "phase functions; overhead/task = (wall - compute) / task executions. "
             "Flyte overhead = Arrow IPC write/read + sha256 of every batch, decks, the run report (per-step "
             "artifacts + index.html), flytekit's local task machinery (its async literal conversion is most of it). "
             "When a step computes for only a few hundred ms (tiny-grpo), that fixed per-task cost dominates the "
             "ratio; with real models a step computes for seconds to minutes. OMP_NUM_THREADS=1.")
    report("orchestration", "Orchestration overhead of a local Flyte run", header, rows, data, notes, cell="local_flyte")


if __name__ == "__main__":
    main()
