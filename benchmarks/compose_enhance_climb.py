"""Does the prompt enhancer learn? Runs a compose recipe (``shapes-enhance``) through ``run_compose_local`` for each
seed, one after another (2 shared cores: one run at a time), and reports per seed: the training reward per third of
the run, the enhancer's reward per third, and the greedy fixed-noise evaluation (``eval/reward/mean`` vs the copy
baseline ``eval/copy_reward/mean``) at step 0 and the last step; then mean and spread over the seeds.

    python benchmarks/compose_enhance_climb.py --seeds 0 1                        # the recipe as shipped
    python benchmarks/compose_enhance_climb.py --seeds 0 1 --name independent --overrides grouping.image_noise=independent

Writes ``benchmarks/results/compose_enhance_climb_<name>.json`` (``--results`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import environment, pin_threads  # noqa: E402


def thirds(values: list[float]) -> list[float]:
    """Means of the first, middle and last third of ``values`` (the later thirds take the remainder)."""
    n = len(values)
    cuts = [0, n // 3, 2 * n // 3, n]
    return [statistics.fmean(values[a:b]) for a, b in zip(cuts, cuts[1:])]


def balanced_thirds(per_step: list[dict[str, list[float]]]) -> list[float]:
    """Training reward per third with the prompt mix held fixed: each caption's mean image reward within the third,
    averaged over the captions every third saw (a step samples 4 of the 16 prompts, and the captions' own success
    rates differ from 0 to ~0.6, so the plain per-third mean mostly measures which captions were drawn)."""
    n = len(per_step)
    cuts = [0, n // 3, 2 * n // 3, n]
    pooled = []
    for a, b in zip(cuts, cuts[1:]):
        by: dict[str, list[float]] = {}
        for step in per_step[a:b]:
            for prompt, rewards in step.items():
                by.setdefault(prompt, []).extend(rewards)
        pooled.append(by)
    common = set(pooled[0]) & set(pooled[1]) & set(pooled[2])
    return [statistics.fmean(statistics.fmean(third[p]) for p in sorted(common)) for third in pooled]


def _image_rewards(batch) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for s in batch:
        image = s.parts[1]
        out.setdefault(image.prompt, []).append(image.reward if image.reward is not None else 0.0)
    return out


def run_seed(recipe: str, seed: int, root: str, overrides: list[str]) -> dict:
    """One run: per-step rewards, thirds and the evaluations of step 0 and the last step."""
    from unirl_core.compose import load_compose_recipe
    from unirl_core.compose.local import run_compose_local

    cfg = load_compose_recipe(recipe, [f"checkpoint.root={root}", f"name={recipe}-seed{seed}", f"loop.seed={seed}",
                                       "report.tensorboard=false", *overrides])
    t0 = time.perf_counter()
    per_step: list[dict[str, list[float]]] = []
    hist = run_compose_local(cfg, resume_from="never", progress=True,
                             on_step=lambda m, batch: per_step.append(_image_rewards(batch)))
    steps = [h for h in hist if "reward/mean" in h]
    reward = [h["reward/mean"] for h in steps]
    enhancer = [h["enhancer/reward/mean"] for h in steps]
    evals = {int(h["step"]): {k: h[k] for k in ("eval/reward/mean", "eval/copy_reward/mean", "eval/enhancement_gain",
                                                 "eval/exact_copy_fraction")} for h in hist if "eval/reward/mean" in h}
    first, last = min(evals), max(evals)
    return {"seed": seed, "seconds": time.perf_counter() - t0, "reward": reward, "reward_thirds": thirds(reward),
            "reward_thirds_prompt_balanced": balanced_thirds(per_step),
            "enhancer_reward_thirds": thirds(enhancer), "evals": evals,
            "eval_gain_over_training": evals[last]["eval/reward/mean"] - evals[first]["eval/reward/mean"],
            "ratio_first_update": {s: steps[0].get(f"{s}/train/ratio_mean") for s in ("enhancer", "image")}}


def summary(runs: list[dict]) -> dict:
    """Mean and spread (min, max) over the seeds of the numbers the README quotes."""
    def stat(values: list[float]) -> dict:
        return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}

    last_third = [r["reward_thirds"][2] - r["reward_thirds"][0] for r in runs]
    balanced = [r["reward_thirds_prompt_balanced"][2] - r["reward_thirds_prompt_balanced"][0] for r in runs]
    return {"reward_last_minus_first_third": stat(last_third),
            "reward_last_minus_first_third_prompt_balanced": stat(balanced),
            "eval_gain_over_training": stat([r["eval_gain_over_training"] for r in runs]),
            "eval_last_minus_copy": stat([r["evals"][max(r["evals"])]["eval/enhancement_gain"] for r in runs])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="shapes-enhance")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--name", default="recipe", help="results file suffix")
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    pin_threads(1)
    runs = []
    with tempfile.TemporaryDirectory() as root:
        for seed in args.seeds:
            runs.append(run_seed(args.recipe, seed, root, list(args.overrides)))
            r = runs[-1]
            print(f"seed {seed}: reward thirds {[round(x, 3) for x in r['reward_thirds']]}, prompt-balanced "
                  f"{[round(x, 3) for x in r['reward_thirds_prompt_balanced']]}, eval "
                  f"{ {k: round(v['eval/reward/mean'], 3) for k, v in r['evals'].items()} }", flush=True)
    res = {"recipe": args.recipe, "overrides": args.overrides, "seeds": args.seeds, "runs": runs,
           "summary": summary(runs), "environment": environment()}
    out = Path(args.results) / f"compose_enhance_climb_{args.name}.json"
    out.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
