"""Re-scoring the composed climb with a faithfulness reward: does the enhancer climb by keeping the caption?

Trains ``shapes-enhance`` (the enhancer under GRPO, the shapes-sd3 image model frozen; eval off) with
``checkpoint.keep_batches: true``, then re-scores every step's stored samples without training
(``unirl_core.runs.rescore``): the enhancer's rewrites (Part 0) with ``caption_recall`` (the fraction of the
caption's words a rewrite keeps, ``examples/compose_enhance/faithfulness.py``) against the image reward the run
trained on. Reports both per third of the run and per step, the mean per-sample correlation, and what the rewrites
look like per third (mean tokens, fraction empty). The baseline is
the run's own reward (the stored ``Part.reward``), measured in the same run.

    python benchmarks/rescore_compose.py                 # 40 steps, seed 0 (~4-6 min on 2 CPU cores)
    python benchmarks/rescore_compose.py --steps 60 --seed 1
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import environment, format_table, pin_threads, write_record  # noqa: E402
from benchmarks.compose_enhance_climb import thirds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipe", default="shapes-enhance")
    args = ap.parse_args()
    pin_threads(1)
    from unirl_core.compose.config import load_compose_recipe
    from unirl_core.compose.local import run_compose_local
    from unirl_core.checkpoint.batches import BatchStore
    from unirl_core.runs.rescore import parse_reward_arg, rescore

    with tempfile.TemporaryDirectory() as root:
        cfg = load_compose_recipe(args.recipe, [f"checkpoint.root={root}", "checkpoint.keep_batches=true",
                                                f"loop.total_steps={args.steps}", f"loop.seed={args.seed}",
                                                "eval=null", "report.tensorboard=false"])
        t0 = time.perf_counter()
        history = [h for h in run_compose_local(cfg, resume_from="never", progress=False) if h["step"] >= 1]
        train_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        table = rescore(f"{root}/{cfg.name}", [parse_reward_arg("faith=caption_recall@0")], write=False)
        rescore_s = time.perf_counter() - t1
        batches = BatchStore(root, cfg.name)
        empty = [sum(not (s.parts[0].text or "").strip() for s in b.samples) / len(b.samples)
                 for b in map(batches.load, batches.steps())]
    tokens = [h["rollout/enhancer_tokens_mean"] for h in history]
    run = [r.run for r in table.rows]
    faith = [r.means["faith"] for r in table.rows]
    corr = [r.correlations["faith"] for r in table.rows if not math.isnan(r.correlations["faith"])]
    results = {"recipe": args.recipe, "seed": args.seed, "steps": args.steps,
               "run_reward_thirds": [round(v, 4) for v in thirds(run)],
               "caption_recall_thirds": [round(v, 4) for v in thirds(faith)],
               "rewrite_tokens_thirds": [round(v, 2) for v in thirds(tokens)],
               "empty_rewrite_frac_thirds": [round(v, 4) for v in thirds(empty)],
               "mean_corr_run_faith": round(sum(corr) / len(corr), 4), "train_s": round(train_s, 1),
               "rescore_s": round(rescore_s, 1),
               "per_step": [{"step": r.step, "run": round(r.run, 4), "caption_recall": round(r.means["faith"], 4),
                             "corr": None if math.isnan(r.correlations["faith"]) else round(r.correlations["faith"], 4)}
                            for r in table.rows]}
    summary = format_table(["", "first third", "middle third", "last third"],
                           [["image reward (trained on)", *results["run_reward_thirds"]],
                            ["caption_recall of the rewrites", *results["caption_recall_thirds"]],
                            ["rewrite tokens (mean)", *results["rewrite_tokens_thirds"]],
                            ["empty rewrites (fraction)", *results["empty_rewrite_frac_thirds"]]])
    steps = format_table(["step", "image reward", "caption_recall", "corr"],
                         [[p["step"], p["run"], p["caption_recall"], p["corr"]] for p in results["per_step"]])
    md = (f"{args.recipe}, seed {args.seed}, {args.steps} steps (training {train_s:.0f} s, re-scoring "
          f"{rescore_s:.0f} s); mean per-step correlation of caption_recall with the image reward "
          f"{results['mean_corr_run_faith']}.\n\n{summary}\n\n{steps}")
    print(md)
    write_record("rescore_compose", results, md, cell=f"{args.recipe}_s{args.seed}", env=environment(),
                 headline=f"{args.recipe}: image reward thirds {results['run_reward_thirds']}, caption_recall "
                          f"thirds {results['caption_recall_thirds']}")


if __name__ == "__main__":
    main()
