"""Does the prompt enhancer learn? Runs a compose recipe (``shapes-enhance``) through ``run_compose_local`` for each
seed, one after another (2 shared cores: one run at a time), and reports per seed: the training reward per third of
the run and its climb statistics (``unirl_core.report.climb``: thirds rising, last tenth >= 3 noise std above the
first, Spearman >= 0.6), the enhancer's reward per third, what the sampled rewrites look like per third (exact
copies of the caption, empty rewrites, words), the greedy fixed-noise evaluation (``eval/reward/mean`` vs the copy
baseline ``eval/copy_reward/mean``, both with the image stack's version of that step) at step 0 and the last step,
and the first update's ratio on both Parts; then mean and spread over the seeds.

    python benchmarks/compose_enhance_climb.py --seeds 0 1                        # shapes-enhance as shipped
    python benchmarks/compose_enhance_climb.py --seeds 0 1 --name independent --overrides grouping.image_noise=independent
    python benchmarks/compose_enhance_climb.py --recipe shapes-enhance-joint --name joint                   # both stacks
    python benchmarks/compose_enhance_climb.py --recipe shapes-enhance-joint --name joint_enhancer_frozen \
        --overrides enhancer.frozen=true                                                   # the ablation: image only

Writes cell ``<name>`` of ``benchmarks/results/compose_enhance_sweep/latest.{json,md}`` (``--results`` elsewhere).
The climb test (``tests/integration/test_first_run_learns.py``) calls ``measure`` on ``shapes-enhance-colour``'s
first 48 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import environment, pin_threads, write_record  # noqa: E402
from unirl_core.compose.engine import enhancement_id  # noqa: E402
from unirl_core.report.climb import climb_stats  # noqa: E402


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


def _rewrites(batch) -> dict[str, float]:
    """What the step's sampled rewrites are (one per enhancement, not per image): exact copies of the caption, the
    reward's target caption (``targets['caption']`` of a prompt that leaves words out; the prompt otherwise), empty
    rewrites, mean words, distinct texts per caption."""
    seen: dict[str, tuple[str, str, str]] = {}
    for s in batch:
        target = s.parts[0].targets.get("caption", s.parts[0].prompt)
        seen.setdefault(enhancement_id(s), (s.parts[0].prompt, (s.parts[0].text or "").strip(), target))
    pairs = list(seen.values())
    per_caption: dict[str, set[str]] = {}
    for prompt, text, _ in pairs:
        per_caption.setdefault(prompt, set()).add(text)
    return {"exact_copy": statistics.fmean(text == prompt for prompt, text, _ in pairs),
            "target_caption": statistics.fmean(text == target for _, text, target in pairs),
            "empty": statistics.fmean(text == "" for _, text, _ in pairs),
            "words": statistics.fmean(len(text.split()) for _, text, _ in pairs),
            "distinct_per_caption": statistics.fmean(len(v) for v in per_caption.values())}


def run_seed(recipe: str, seed: int, root: str, overrides: list[str], progress: bool = True) -> dict:
    """One run: per-step rewards, thirds and the evaluations of step 0 and the last step."""
    from unirl_core.compose import load_compose_recipe
    from unirl_core.compose.local import run_compose_local

    cfg = load_compose_recipe(recipe, [f"checkpoint.root={root}", f"name={recipe}-seed{seed}", f"loop.seed={seed}",
                                       "report.tensorboard=false", *overrides])
    t0 = time.perf_counter()
    per_step: list[dict[str, list[float]]] = []
    rewrites: list[dict[str, float]] = []
    last_texts: dict[str, list[str]] = {}

    def on_step(m, batch):
        per_step.append(_image_rewards(batch))
        rewrites.append(_rewrites(batch))
        last_texts.clear()
        for s in batch:
            last_texts.setdefault(s.parts[0].prompt, []).append(s.parts[0].text or "")

    hist = run_compose_local(cfg, resume_from="never", progress=progress, on_step=on_step)
    steps = [h for h in hist if "reward/mean" in h]
    reward = [h["reward/mean"] for h in steps]
    enhancer = [h["enhancer/reward/mean"] for h in steps]
    evals = {int(h["step"]): {k: h[k] for k in ("eval/reward/mean", "eval/copy_reward/mean", "eval/enhancement_gain",
                                                 "eval/exact_copy_fraction")} for h in hist if "eval/reward/mean" in h}
    first, last = min(evals), max(evals)
    stats = climb_stats(reward)
    return {"seed": seed, "seconds": time.perf_counter() - t0, "reward": reward, "reward_thirds": thirds(reward),
            "climb": {**dataclasses.asdict(stats), "summary": stats.summary(), "failures": stats.failures()},
            "reward_thirds_prompt_balanced": balanced_thirds(per_step),
            "enhancer_reward_thirds": thirds(enhancer), "evals": evals,
            "eval_gain_over_training": evals[last]["eval/reward/mean"] - evals[first]["eval/reward/mean"],
            "rewrites_thirds": {k: thirds([r[k] for r in rewrites]) for k in rewrites[0]},
            "last_step_rewrites": last_texts,
            "ratio_first_update": {s: [steps[0].get(f"{s}/train/ratio_{k}") for k in ("min", "mean", "max")]
                                   for s in ("enhancer", "image")}}


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


def seed_to_file(recipe: str, seed: int, root: str, overrides: list[str], out: str) -> None:
    """``run_seed`` in a subprocess of ``measure(jobs=...)``: its record as JSON in ``out``."""
    pin_threads(1)
    Path(out).write_text(json.dumps(run_seed(recipe, seed, root, overrides, progress=False), default=str))


def measure(recipe: str, seeds: list[int], root: str, overrides: list[str] = (), progress: bool = True, *,
            jobs: int = 1, subprocesses: bool = False, timeout: float = 7200) -> dict:
    """Every seed under ``root`` (``jobs`` > 1 or ``subprocesses``: ``jobs`` side by side, each a single-threaded
    subprocess; else one after another in this process): the runs and their summary."""
    if jobs > 1 or subprocesses:
        from benchmarks.first_run_climb import seeds_in_subprocesses

        outs = seeds_in_subprocesses(recipe, list(seeds), root, list(overrides), jobs, timeout,
                                     target="benchmarks.compose_enhance_climb:seed_to_file")
        runs = [{**outs[s], "evals": {int(k): v for k, v in outs[s]["evals"].items()}}  # JSON made steps strings
                for s in seeds]
    else:
        runs = [run_seed(recipe, seed, root, list(overrides), progress) for seed in seeds]
    for seed, r in zip(seeds, runs):
        print(f"seed {seed}: {r['climb']['summary']}; misses: {r['climb']['failures'] or 'none'}; eval "
              f"{ {k: round(v['eval/reward/mean'], 3) for k, v in r['evals'].items()} }", flush=True)
    return {"recipe": recipe, "overrides": list(overrides), "seeds": list(seeds), "runs": runs,
            "summary": summary(runs)}


def markdown(res: dict) -> str:
    """One row per seed: climb statistics, eval at the first and last step (enhanced / copy), rewrites, ratio."""
    rows = [("| seed | reward thirds | last vs first tenth (noise std) | Spearman | climbs | eval first -> last "
             "(copy) | sampled exact copies per third | first-update ratio enhancer / image | s |"),
            "|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        c, ev = r["climb"], r["evals"]
        a, b = ev[min(ev)], ev[max(ev)]
        rows.append(
            f"| {r['seed']} | {' / '.join(f'{t:.3f}' for t in c['thirds'])} | {c['first_tenth']:.3f} -> "
            f"{c['last_tenth']:.3f} ({c['z']:.1f} of {c['noise_std']:.3f}) | {c['spearman']:.2f} | "
            f"{'yes' if not c['failures'] else 'no'} | {a['eval/reward/mean']:.3f} ({a['eval/copy_reward/mean']:.3f})"
            f" -> {b['eval/reward/mean']:.3f} ({b['eval/copy_reward/mean']:.3f}) | "
            f"{' / '.join(f'{t:.2f}' for t in r['rewrites_thirds']['exact_copy'])} | "
            f"{r['ratio_first_update']['enhancer'][1]} / {r['ratio_first_update']['image'][1]} | {r['seconds']:.0f} |")
    over = " ".join(res["overrides"]) or "none"
    return (f"### compose_enhance_climb: {res['recipe']} (overrides: {over})\n\n" + "\n".join(rows) +
            f"\n\n_Hardware/versions: {', '.join(f'{k} {v}' for k, v in res['environment'].items())}._\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="shapes-enhance")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--name", default="recipe", help="cell of the compose_enhance_sweep record")
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--jobs", type=int, default=1, help="seeds side by side, each a single-threaded subprocess")
    args = ap.parse_args()
    pin_threads(1)
    with tempfile.TemporaryDirectory() as root:
        res = {**measure(args.recipe, args.seeds, root, args.overrides, jobs=args.jobs), "environment": environment()}
    write_record("compose_enhance_sweep", res, markdown(res), cell=args.name, env=res["environment"],
                 results_dir=Path(args.results))
    print(markdown(res))
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
