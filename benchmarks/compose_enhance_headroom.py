"""How much can ANY rewrite gain with the frozen image model? The headroom of a compose recipe's enhancer.

For every caption of the recipe's prompt set, every caption-shaped text of the shapes world (``<a|two|three>
<colour> <shape(s)>``, the recipe's colours) and the empty prompt is rendered with a selection noise set; the best
text per caption is picked there and then scored on the evaluation's own fixed noise (``compose/evaluate.py``:
same records, same seed), so the selection's luck does not inflate the number. Prints and writes the caption's own
score, the empty prompt's and the selected rewrites' (the "oracle" a perfect caption-form enhancer would reach).

    python benchmarks/compose_enhance_headroom.py            # shapes-enhance as shipped

Writes ``benchmarks/results/compose_enhance_headroom/latest.{json,md}`` (``--forms``: cell ``--name`` of
``compose_enhance_forms/latest.{json,md}``).

``--forms`` asks another question of the image model: what does it follow? Every caption is rendered as is and
in altered forms (words reversed, words shuffled, the colour dropped, every colour word replaced by another colour
(the first of red / green / blue / yellow the caption does not name), the shape alone, empty), each scored against
the caption on the evaluation's noise. A form that scores well below the caption is one an enhancer could repair
(the user writes it, the enhancer rewrites it into the caption); a form that scores as well says the model does
not read what the form changed. Writes ``compose_enhance_forms[_<name>].json``; ``--override`` changes the
recipe (e.g. another image model: ``image.diffusion.model.source=<export dir>``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import environment, pin_threads, write_record  # noqa: E402


def candidates(colors: list[str]) -> list[str]:
    from examples.shapes.data import SHAPES

    words = {1: "a", 2: "two", 3: "three"}
    return [""] + [f"{words[n]} {c} {s}{'s' if n > 1 else ''}" for n in (1, 2, 3) for c in colors for s in SHAPES]


def forms(caption: str, colours: frozenset[str]) -> dict[str, str]:
    """Altered forms of a caption (``--forms``): the shuffle is a fixed permutation per caption (seeded by its
    text) that differs from the caption."""
    import random
    import zlib

    words = caption.split()
    shuffled = list(words)
    rng = random.Random(zlib.crc32(caption.encode()))
    for _ in range(20):
        rng.shuffle(shuffled)
        if shuffled != words:
            break
    from examples.shapes.data import DEFAULT_COLORS

    other = next((c for c in DEFAULT_COLORS if c not in words), None)
    return {"caption": caption, "reversed": " ".join(reversed(words)), "shuffled": " ".join(shuffled),
            "no colour": " ".join(w for w in words if w not in colours),
            "other colour": " ".join(other if w in colours else w for w in words),
            "shape only": words[-1], "empty": ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="shapes-enhance")
    ap.add_argument("--images", type=int, default=8, help="images per caption and text, per noise set")
    ap.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--forms", action="store_true", help="score altered forms of each caption (see above)")
    ap.add_argument("--override", action="append", default=[], help="a recipe override a.b=value")
    ap.add_argument("--name", default="default", help="--forms: cell of the compose_enhance_forms record")
    args = ap.parse_args()
    pin_threads(1)
    from unirl_core.compose import load_compose_recipe
    from unirl_core.compose.config import stack_configs
    from unirl_core.compose.evaluate import _render
    from examples.shapes.data import DEFAULT_COLORS
    from unirl_core.runtime import build
    from unirl_core.loop.executors import in_process
    from unirl_core.rollout.diffusion import TrainsideDiffusionEngine
    from unirl_core.types import PromptRecord

    cfg = load_compose_recipe(args.recipe, args.override)
    subs = stack_configs(cfg)
    img_sub = subs["image"]
    seen: dict[str, PromptRecord] = {}
    for r in build.dataset(subs["enhancer"]).records:  # the evaluation's records (same ids: same noise)
        seen.setdefault(r.prompt, PromptRecord(prompt_id=f"eval{len(seen):04d}", prompt=r.prompt, targets=r.targets))
    evals = list(seen.values())
    select = [PromptRecord(prompt_id=f"select{k:04d}", prompt=r.prompt, targets=r.targets) for k, r in enumerate(evals)]
    bundle = in_process().resources.bundle(img_sub)
    engine = TrainsideDiffusionEngine(bundle, img_sub.diffusion.engine)
    sampling = img_sub.diffusion.sampling.params(bundle.family, 1)
    scorer = build.reward_service(img_sub)
    n = args.images

    def score(records, texts: dict[str, str]) -> list[float]:
        r = _render(engine, records, texts, n, sampling, scorer)
        return [statistics.fmean(r[k * n:(k + 1) * n]) for k in range(len(records))]

    t0 = time.perf_counter()
    if args.forms:
        from examples.shapes.data import PALETTE

        # the caption the reward wants (a recipe whose prompts leave words out keeps it in targets['caption'])
        alt = {r.prompt_id: forms(r.targets.get("caption", r.prompt), frozenset(PALETTE)) for r in evals}
        names = list(alt[evals[0].prompt_id])
        per = {f: score(evals, {pid: a[f] for pid, a in alt.items()}) for f in names}
        res = {"recipe": args.recipe, "overrides": args.override, "images_per_caption": n, "captions": len(evals),
               "mean": {f: statistics.fmean(v) for f, v in per.items()},
               "per_caption": [{f: {"text": alt[r.prompt_id][f], "score": per[f][k]} for f in names}
                               for k, r in enumerate(evals)],
               "seconds": time.perf_counter() - t0, "environment": environment()}
        for f in names:
            print(f"{f:>10}: {res['mean'][f]:.3f}   e.g. {alt[evals[0].prompt_id][f]!r}")
        md = "| form | mean reward |\n|---|---:|\n" + "".join(f"| {f} | {v:.3f} |\n" for f, v in res["mean"].items())
        write_record("compose_enhance_forms", res, md, cell=args.name, env=res["environment"],
                     results_dir=Path(args.results))
        return
    texts = candidates(list(DEFAULT_COLORS))
    on_select = {t: score(select, {r.prompt_id: t for r in select}) for t in texts}
    on_select["<caption>"] = score(select, {r.prompt_id: r.prompt for r in select})
    best = {r.prompt: max(on_select, key=lambda t: on_select[t][k]) for k, r in enumerate(select)}
    pick = {r.prompt_id: (r.prompt if best[r.prompt] == "<caption>" else best[r.prompt]) for r in evals}
    caption = score(evals, {r.prompt_id: r.prompt for r in evals})
    empty = score(evals, {r.prompt_id: "" for r in evals})
    oracle = score(evals, pick)
    res = {"recipe": args.recipe, "images_per_caption": n, "candidates": len(texts) + 1,
           "eval": {"caption": statistics.fmean(caption), "empty": statistics.fmean(empty),
                    "selected_rewrites": statistics.fmean(oracle)},
           "per_caption": [{"caption": r.prompt, "rewrite": pick[r.prompt_id], "caption_score": c, "empty_score": e,
                            "rewrite_score": o} for r, c, e, o in zip(evals, caption, empty, oracle)],
           "seconds": time.perf_counter() - t0, "environment": environment()}
    for row in res["per_caption"]:
        print(f"{row['caption']:>22} -> {row['rewrite']!r:24} caption {row['caption_score']:.3f} empty "
              f"{row['empty_score']:.3f} rewrite {row['rewrite_score']:.3f}")
    print(json.dumps(res["eval"]))
    md = "| caption | empty | selected rewrites |\n|---:|---:|---:|\n| " + " | ".join(
        f"{res['eval'][k]:.3f}" for k in ("caption", "empty", "selected_rewrites")) + " |"
    write_record("compose_enhance_headroom", res, md, env=res["environment"], results_dir=Path(args.results))


if __name__ == "__main__":
    main()
