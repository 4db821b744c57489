"""A named pool shared by runs (``pool.name``) vs a pool per run: tiny LoRA runs, each its own driver process.

One local Ray head (this process starts it); every run is a separate driver process attached to it
(``pool.address``), as scheduled retraining and sweep runs are. Roles reserve a quarter CPU each (one torch thread),
so several pools fit the head.

- **first step**: a run's first step (driver side: from ``run_local``'s start to step 1's metrics; imports and the
  Ray connection excluded, the same on both sides) when it starts a pool of its own (``cold``: actors start, import
  torch and the model code, build) vs when it attaches to a named pool that another run has warmed (``warm``: its
  tenants are built in processes already running). Median over ``--repeats``.
- **aggregate throughput**: ``--runs`` runs at once, every one in the named pool vs each with its own pool; total
  steps of all runs over the wall time from the first driver's start to the last one's end (driver start-up
  included on both sides).
- **host memory**: ``--tenants`` runs (own names and seeds) attached to a fresh named pool the way a driver attaches
  (``NamedPool``, each role's tenant built in its host), read from each host (``TenantHost.memory``) with 1 tenant
  and with all: parameter and buffer bytes counted once per distinct storage (the frozen base tensors are shared,
  ``pool/frozen.py``) vs the sum of each tenant's own count (what the tenants hold without sharing), and the host
  process's RSS.

    OMP_NUM_THREADS=1 python benchmarks/bench_shared_pool.py [--recipe tiny-grpo] [--runs 2] [--steps 6] [--tenants 4]
    # the host memory alone at a wider base (the tiny presets are ~0.5 MB):
    OMP_NUM_THREADS=1 python benchmarks/bench_shared_pool.py --memory-only --cell tiny-grpo-wide --model \
        lm.model.tiny.hidden_size=768 lm.model.tiny.num_layers=8 lm.model.tiny.intermediate_size=2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import report  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LORA = {"tiny-grpo": "lm.model.finetune=lora", "tiny-flow-grpo": "diffusion.model.finetune=lora"}
SMALL = {"tiny-grpo": ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
                       "lm.engine.forward_batch_size=8"],
         "tiny-flow-grpo": ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=4",
                            "diffusion.engine.forward_batch_size=4", "diffusion.sampling.num_steps=4"]}

DRIVER = r"""
import json, sys, time
from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local
from unirl_core.pool import cluster
cfg = load_recipe(sys.argv[1], sys.argv[2:])
marks = []
t0 = time.perf_counter()
hist = run_local(cfg, on_step=lambda m, b: marks.append(time.perf_counter() - t0))
print("RESULT " + json.dumps({"first_step_s": marks[0], "run_s": marks[-1], "steps": len(hist)}), flush=True)
cluster.close_pool()  # a pool of its own on an attached cluster is detached: free it (the named pool: detach)
"""


def driver(recipe: str, root: Path, name: str, steps: int, gcs: str, pool: str | None,
           extra: list[str]) -> subprocess.Popen:
    overrides = [*SMALL[recipe], LORA[recipe], *extra, f"loop.total_steps={steps}", f"checkpoint.root={root}",
                 f"name={name}", "pool.execution=pool", "pool.publish=object_store", "pool.engine.num_cpus=0.25",
                 "pool.trainer.num_cpus=0.25", f"pool.address={gcs}", *([f"pool.name={pool}"] if pool else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", DRIVER, recipe, *overrides], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(err[-3000:])
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0])


def host_memory(recipe: str, root: Path, gcs: str, tenants: int,
                extra: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    """role -> {"1": memory with one tenant, "<n>": with ``tenants``} of a fresh named pool's hosts."""
    import ray

    from unirl_core.config import load_recipe
    from unirl_core.config.loader import config_key
    from unirl_core.pool.tenants import NamedPool

    views, out = [], {}
    for i in range(tenants):
        overrides = [*SMALL[recipe], LORA[recipe], *extra, f"checkpoint.root={root}", f"name=mem-{i}", f"loop.seed={i}",
                     "pool.execution=pool", "pool.publish=object_store", "pool.engine.num_cpus=0.25",
                     "pool.trainer.num_cpus=0.25", f"pool.address={gcs}", "pool.name=bench-memory"]
        cfg = load_recipe(recipe, overrides)
        view = NamedPool(cfg, config_key(cfg))
        views.append(view)
        for role in view.roles:
            view.actor(role)  # the run's tenant is built in the role's host
        if i + 1 in (1, tenants):
            for role in view.roles:
                out.setdefault(role, {})[str(i + 1)] = ray.get(view.hosts[role].memory.remote(), timeout=300)
    for view in views:
        view.close()
    return out


def timing(r: str, root: Path, gcs: str, args, extra: list[str]) -> tuple[dict, list[list]]:
    """First step cold vs warm and the aggregate throughput of ``args.runs`` runs: record fields and table rows."""
    result(driver(r, root, "warmup", 1, gcs, "bench", extra))  # the named pool's processes start (and stay)
    cold, warm = [], []
    for i in range(args.repeats):  # alternated: drift on a shared machine hits both sides
        cold.append(result(driver(r, root, f"cold-{i}", 1, gcs, None, extra))["first_step_s"])
        warm.append(result(driver(r, root, f"warm-{i}", 1, gcs, "bench", extra))["first_step_s"])

    def together(pool: str | None, tag: str) -> tuple[float, list[dict]]:
        t0 = time.perf_counter()
        procs = [driver(r, root, f"{tag}-{i}", args.steps, gcs, pool, extra) for i in range(args.runs)]
        got = [result(p) for p in procs]
        return time.perf_counter() - t0, got

    own_s, own = together(None, "own")
    shared_s, shared = together("bench", "shared")
    total = args.runs * args.steps
    data = {"runs": args.runs, "steps": args.steps, "repeats": args.repeats,
            "first_step_cold_s": cold, "first_step_warm_s": warm,
            "first_step_cold_median_s": statistics.median(cold), "first_step_warm_median_s": statistics.median(warm),
            "first_step_ratio_cold_over_warm": statistics.median(cold) / statistics.median(warm),
            "aggregate_own_pools_steps_per_s": total / own_s, "aggregate_shared_pool_steps_per_s": total / shared_s,
            "aggregate_ratio_shared_over_own": own_s / shared_s, "own_runs": own, "shared_runs": shared}
    rows = [["first step, own pool (cold)", f"{data['first_step_cold_median_s']:.2f} s", "1.00"],
            ["first step, warm named pool", f"{data['first_step_warm_median_s']:.2f} s",
             f"{data['first_step_warm_median_s'] / data['first_step_cold_median_s']:.2f}"],
            [f"{args.runs} runs x {args.steps} steps, a pool each", f"{total / own_s:.3f} steps/s", "1.00"],
            [f"{args.runs} runs x {args.steps} steps, one named pool", f"{total / shared_s:.3f} steps/s",
             f"{own_s / shared_s:.2f}"]]
    return data, rows


def memory_rows(memory: dict, tenants: int) -> tuple[dict, list[list]]:
    """The host memory's record fields and table rows (engine and trainer hosts)."""
    n, data, rows = str(tenants), {}, []
    for role in ("engine-0", "trainer"):
        one, many = memory[role]["1"], memory[role][n]
        data[f"{role}_param_mb_1_tenant"] = one["param_bytes"] / 1e6
        data[f"{role}_param_mb_{n}_tenants_shared"] = many["param_bytes"] / 1e6
        data[f"{role}_param_mb_{n}_tenants_unshared"] = many["param_bytes_unshared"] / 1e6
        data[f"{role}_param_ratio_shared_over_unshared"] = many["param_bytes"] / many["param_bytes_unshared"]
        data[f"{role}_rss_mb_1_tenant"] = one["rss_bytes"] / 1e6
        data[f"{role}_rss_mb_{n}_tenants"] = many["rss_bytes"] / 1e6
        rows += [[f"{role} host, {n} tenants: parameter bytes, one copy each (not shared)",
                  f"{many['param_bytes_unshared'] / 1e6:.2f} MB", "1.00"],
                 [f"{role} host, {n} tenants: parameter bytes, frozen base shared (1 tenant: "
                  f"{one['param_bytes'] / 1e6:.2f} MB)", f"{many['param_bytes'] / 1e6:.2f} MB",
                  f"{many['param_bytes'] / many['param_bytes_unshared']:.2f}"],
                 [f"{role} host RSS, 1 -> {n} tenants", f"{one['rss_bytes'] / 1e6:.0f} -> "
                  f"{many['rss_bytes'] / 1e6:.0f} MB", ""]]
    return data, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="tiny-grpo", choices=sorted(LORA))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--model", nargs="*", default=[], help="overrides of every run (e.g. a wider tiny model)")
    ap.add_argument("--memory-only", action="store_true", help="only the host memory (a large base)")
    ap.add_argument("--cell", default=None, help="the record's cell (default: the recipe)")
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray's memory monitor kills actors when the node is near full, whoever fills it (a shared machine); the
    # runs here take a few hundred MB each
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    gcs = ray.get_runtime_context().gcs_address
    root = Path(tempfile.mkdtemp(prefix="bench-shared-pool-"))
    r = args.recipe
    data, rows = {"recipe": r, "model_overrides": args.model, "tenants": args.tenants}, []
    if not args.memory_only:
        got, rows = timing(r, root, gcs, args, args.model)
        data.update(got)
    memory = host_memory(r, root, gcs, args.tenants, args.model)
    got, more = memory_rows(memory, args.tenants)
    data.update(got, host_memory=memory)
    rows += more
    model = f" ({' '.join(args.model)})" if args.model else ""
    notes = (f"CPU, 2 cores shared with other work, a local Ray head of 2 CPUs; {r} with LoRA{model}. "
             + ("" if args.memory_only else
                "Each role a quarter CPU and one torch thread, every run its own driver process. First step: "
                "driver-side, from run_local's start (Ray connected, imports done) to step 1's metrics, median of "
                f"{args.repeats}. Aggregate: all runs' steps over the wall time of the set, driver start-up "
                "included. ")
             + f"Host memory: {args.tenants} tenants attached to a fresh named pool as drivers attach (NamedPool); "
             "parameter bytes counted once per distinct storage (params and buffers of every tenant's modules); the "
             "unshared side is the sum of each tenant's own count, what the host holds when every tenant keeps the "
             "base it built; RSS of the host process (imports, allocator and Python objects included; a tenant "
             "that has not trained holds no optimizer state).")
    report("shared_pool", f"Named pool shared by runs vs a pool per run ({r}{model}, CPU)",
           ["case", "value", "ratio to the pool-per-run side"], rows, data, notes, cell=args.cell or r)


if __name__ == "__main__":
    main()
