"""Lagged rollouts vs the synchronous loop: tiny-grpo through ``run_local``, equal samples, several seeds.

Sides (same recipe, same loss: ``train.old_logp_source: replay`` + ``tis_cap: 2``, which is AReaL's decoupled
objective under a lag and a weight of exactly 1 without one):
- ``sync``: ``async_training.max_policy_lag: 0`` (today's loop);
- ``lag1``: ``max_policy_lag: 1``, rollouts on the manager's worker thread (overlap with reward + advantage +
  train + publish of the previous step);
- ``lag1-inline``: ``max_policy_lag: 1``, ``overlap: false``: the same samples and numbers as ``lag1``, no thread;
- ``lag1-partial``: ``lag1`` with partial rollouts: 2 of the 4 tokens sampled with version n-2, the rest with n-1
  (the sampler waits for that publication), old tokens corrected by the same TIS weight;
- ``pool-sync`` / ``pool-lag1``: ``pool.execution: pool`` on a local Ray head this process starts once (engine and
  trainer actors with one CPU each, the reward actor none): lag 0, and lag 1 where the rollout manager runs rollout
  n + 1 on the engine actor while the trainer actor trains n (quiesced before each in-pool publish).

Reported per side: steady-state steps/s (steps 2..N of the driver's wall time, median over seeds; step 1 builds
models, and in the pool starts the actors: reported apart), the median step time, the trainer's wait for rollouts,
and the mean reward per third of the run (mean over seeds, with the spread over seeds as the noise).

    OMP_NUM_THREADS=1 python benchmarks/bench_lagged.py --steps 60 --seeds 3 [--sides sync lag1 pool-sync pool-lag1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import pin_threads, report  # noqa: E402

SIDES = {"sync": ["async_training.max_policy_lag=0"],
         "lag1": ["async_training.max_policy_lag=1"],
         "lag1-inline": ["async_training.max_policy_lag=1", "async_training.overlap=false"],
         "lag1-partial": ["async_training.max_policy_lag=1",
                          "async_training.partial_rollout={interrupt_at_tokens: 2, old_tokens: correct}"],
         "lag1-tis": ["async_training.max_policy_lag=1", "train.old_logp_source=replay",
                      "lm.algorithm.tis_cap=2.0"],
         "pool-sync": ["async_training.max_policy_lag=0", "pool.execution=pool"],
         "pool-lag1": ["async_training.max_policy_lag=1", "pool.execution=pool"]}


def start_ray() -> None:
    """One local Ray head for every pool side (the pools attach to it instead of starting and stopping their own)."""
    import os

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only, as the pool's own head
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)


def run(side: str, seed: int, steps: int, root: Path) -> dict:
    from unirl_core.config import load_recipe
    from unirl_core.loop.local import run_local

    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={root}", f"name=bench-{side}-{seed}", f"loop.seed={seed}",
                                    f"loop.total_steps={steps}", "report.tensorboard=false",
                                    "train.old_logp_source=replay", "lm.algorithm.tis_cap=2.0", *SIDES[side]])
    t0 = time.perf_counter()
    hist = run_local(cfg, progress=False)
    wall = time.perf_counter() - t0
    third = steps // 3
    rewards = [h["reward/mean"] for h in hist]
    # steady state: the driver's wall time of steps 2..N (step 1 builds models; a lagged step's time includes any
    # wait for its rollout, so overlapped rollout time is not hidden)
    return {"wall_s": wall, "steps_per_s": (steps - 1) / sum(h["time/step"] for h in hist[1:]),
            "first_step_s": hist[0]["time/step"], "median_step_s": statistics.median(h["time/step"] for h in hist[1:]),
            "median_quiesce_s": statistics.median(h.get("async/publish_quiesce_s", 0.0) for h in hist[1:]),
            "median_engine_idle": statistics.median(h.get("async/engine_idle_frac", float("nan")) for h in hist[1:]),
            "median_wait_s": statistics.median(h.get("async/rollout_wait_s", h["time/rollout"]) for h in hist),
            "reward_thirds": [statistics.mean(rewards[i * third:(i + 1) * third]) for i in range(3)],
            "staleness_max_after_warmup": max((h.get("async/staleness_max", 0.0) for h in hist[1:]), default=0.0),
            "rewards": rewards}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sides", nargs="+", default=[s for s in SIDES if s != "lag1-tis"], choices=list(SIDES))
    ap.add_argument("--name", default="tiny_grpo_cpu", help="cell of results/lagged/latest.json")
    args = ap.parse_args()
    pin_threads(1)
    if any(side.startswith("pool") for side in args.sides):
        start_ray()
    out: dict[str, list[dict]] = {s: [] for s in args.sides}
    with tempfile.TemporaryDirectory() as tmp:
        for side in args.sides:  # warm-up: imports and the per-process model caches, not recorded
            run(side, 99, 3, Path(tmp))
        for seed in range(args.seeds):
            for side in args.sides:  # interleaved, so machine load drifts hit every side alike
                out[side].append(run(side, seed, args.steps, Path(tmp)))
    rows = []
    for side, runs in out.items():
        thirds = list(zip(*(r["reward_thirds"] for r in runs)))
        cell = lambda xs: f"{statistics.mean(xs):.3f} +- {statistics.pstdev(xs):.3f}"  # noqa: E731
        rows.append([side, f"{statistics.median(r['steps_per_s'] for r in runs):.2f}",
                     f"{statistics.median(r['median_step_s'] for r in runs):.3f}",
                     f"{statistics.median(r['median_wait_s'] for r in runs):.3f}",
                     f"{statistics.median(r['median_quiesce_s'] for r in runs):.3f}",
                     f"{statistics.median(r['first_step_s'] for r in runs):.1f}",
                     *[cell(t) for t in thirds], f"{max(r['staleness_max_after_warmup'] for r in runs):.0f}"])
    same = {f"{a} == {b}": all(x["rewards"] == y["rewards"] for x, y in zip(out[a], out[b]))
            for a, b in (("lag1", "lag1-inline"), ("lag1", "pool-lag1"), ("sync", "pool-sync"))
            if a in out and b in out}
    notes = (f"{args.steps} steps x {args.seeds} seeds per side, tiny-grpo (4 prompts x 8 samples per step), one torch "
             f"thread per process, run_local in one process (pool sides: driver + engine, trainer and reward actors "
             f"on a local Ray head). Rewards identical per seed: {same}. 'quiesce' is the driver's wait for in-flight "
             "rollouts before each publish (pool lag 1: the rest of rollout n+1 after train n); 'first step' "
             "includes model builds (pool: the actors' start; Ray's own start is before the run). "
             "Reward cells: mean over seeds +- population std over seeds (the run-to-run noise). 'wait' is the "
             "driver's time blocked on rollouts per step (sync: the rollout itself). In one process only the "
             "worker thread's rollout overlaps the driver's reward/advantage/train/publish; torch releases the GIL "
             "inside kernels, but Python-level work (tokenizer, sampling loop, checkpoint I/O) serialises, and this "
             "machine's 2 cores are shared with other jobs.")
    report("lagged", "Lagged rollouts (max_policy_lag 1) vs synchronous, tiny-grpo, CPU",
           ["side", "steps/s", "median step s", "median wait s", "median quiesce s", "first step s",
            "reward 1st third", "reward 2nd third",
            "reward 3rd third", "max staleness"], rows,
           {side: [{k: v for k, v in r.items()} for r in runs] for side, runs in out.items()}, notes, cell=args.name)


if __name__ == "__main__":
    main()
