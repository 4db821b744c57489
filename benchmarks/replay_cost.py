"""What replay and kept batches cost: per recipe, a run with ``checkpoint.keep_batches`` against the same run
without (the baseline, measured in the same process), then ``replay`` of three of its steps.

Reports the median step time of both runs and their ratio (the cost of writing each step's batch), the batch
bytes per step beside the version bytes per step, and the median time to replay a step (in the process that
trained, so the models are built) against the median step time. The baseline does everything but write batches.

    python benchmarks/replay_cost.py                        # tiny-flow-grpo and tiny-grpo as shipped, 6 steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import environment, format_table, pin_threads, write_record  # noqa: E402


def _bytes(folder: Path, pattern: str) -> list[int]:
    return [sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
            for p in sorted(folder.glob(pattern))]


def measure(recipe: str, steps: int) -> dict:
    from unirl_core.config import load_recipe
    from unirl_core.loop.local import run_local
    from unirl_core.runs.replay import replay

    with tempfile.TemporaryDirectory() as root:
        over = [f"checkpoint.root={root}", f"loop.total_steps={steps}", "checkpoint.keep_every=1",
                "report.tensorboard=false", "eval=null"]
        base = run_local(load_recipe(recipe, [*over, "name=base"]), progress=False)
        kept = run_local(load_recipe(recipe, [*over, "name=kept", "checkpoint.keep_batches=true"]), progress=False)
        replays = []
        for step in (2, steps // 2 + 1, steps):
            t0 = time.perf_counter()
            replay(f"{root}/kept", step=step)
            replays.append(time.perf_counter() - t0)
        run = Path(root) / "kept"
        batch = statistics.median(_bytes(run / "batches", "step-*.arrow"))
        version = statistics.median(_bytes(run, "step-*[1-9]*"))
    # step 1 pays the model build in a fresh process: the medians are over steps 2..N
    t_base = statistics.median(h["time/step"] for h in base[1:])
    t_kept = statistics.median(h["time/step"] for h in kept[1:])
    t_replay = statistics.median(replays)
    return {"recipe": recipe, "steps": steps, "step_s_base": round(t_base, 3), "step_s_keep_batches": round(t_kept, 3),
            "keep_batches_ratio": round(t_kept / t_base, 3), "batch_kb_per_step": round(batch / 1e3, 1),
            "version_kb_per_step": round(version / 1e3, 1), "replay_s_per_step": round(t_replay, 3),
            "replay_vs_step": round(t_replay / t_kept, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["tiny-flow-grpo", "tiny-grpo"])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    pin_threads(1)
    rows = [measure(r, args.steps) for r in args.recipes]
    keys = ["recipe", "step_s_base", "step_s_keep_batches", "keep_batches_ratio", "batch_kb_per_step",
            "version_kb_per_step", "replay_s_per_step", "replay_vs_step"]
    md = (f"{args.steps} steps per run, medians over steps 2..{args.steps} (step 1 builds the models); replay of 3 "
          f"steps in the process that trained.\n\n" + format_table(keys, [[r[k] for k in keys] for r in rows]))
    print(md)
    write_record("replay_cost", rows, md, env=environment(),
                 headline=", ".join(f"{r['recipe']}: keep_batches x{r['keep_batches_ratio']} step time, "
                                    f"{r['batch_kb_per_step']} KB a step, replay {r['replay_vs_step']} steps"
                                    for r in rows))


if __name__ == "__main__":
    main()
