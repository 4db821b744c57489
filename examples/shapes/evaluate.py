"""Score a shapes-world model: sample held-out shapes prompts and grade them with the ``shapes_compositional``
rule (``examples.shapes.reward``). The renderer's own images of the same prompts are graded too,
as the detector's ceiling.

    python -m examples.shapes.evaluate --source shapes-sd3 --prompts 64
    python -m examples.shapes.evaluate --source runs/sft-shapes/export --prompts 64 --grid samples.png
"""

from __future__ import annotations

import argparse
import io
import json

import numpy as np

from examples.shapes.data import ShapesPromptsConfig, make_dataset, shapes_prompts
from examples.shapes.reward import ShapesCompositional, shapes_accuracy
from unirl_core.reward.scorers.base import ScoreItem

EVAL_SEED = 1000
"""Prompt seed of the evaluation set (the SFT recipe trains on seed 0's records)."""


def _png(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def grade(prompts: list[str], pngs: list[bytes]) -> dict[str, float]:
    """Mean ``shapes_compositional`` (fraction of constraints met) and the per-kind accuracies."""
    items = [ScoreItem(prompt=p, media=m) for p, m in zip(prompts, pngs)]
    scores = ShapesCompositional()(items)
    out = {"reward_mean": float(np.mean(scores))}
    out.update({f"acc/{k}": v for k, v in shapes_accuracy(items).items()})
    return out


def evaluate_model(bundle, *, num_prompts: int = 64, size: int = 32, num_steps: int = 20, shift: float = 3.0,
                   guidance_scale: float = 1.0, seed: int = 0) -> tuple[dict[str, float], list[str], list[bytes]]:
    """Grade ``num_prompts`` held-out prompts sampled from ``bundle`` (ODE, one image each)."""
    from unirl_core.sft.report import sample_images

    prompts = [r.prompt for r in shapes_prompts(ShapesPromptsConfig(num_prompts=num_prompts, seed=EVAL_SEED))]
    pngs = sample_images(bundle, prompts, height=size, width=size, num_steps=num_steps, shift=shift,
                         guidance_scale=guidance_scale, seed=seed)
    return grade(prompts, pngs), prompts, pngs


def renderer_ceiling(num_prompts: int = 64, size: int = 32) -> dict[str, float]:
    """The same grading of the world's own renders (what a perfect model would score under the detector)."""
    pairs = make_dataset(num_prompts, seed=EVAL_SEED, size=size)
    return grade([c for c, _ in pairs], [_png(img) for _, img in pairs])


def save_grid(pngs: list[bytes], path: str, *, columns: int = 8, scale: int = 3) -> None:
    from PIL import Image

    ims = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    w, h = ims[0].size
    rows = (len(ims) + columns - 1) // columns
    grid = Image.new("RGB", (columns * w, rows * h), "white")
    for i, im in enumerate(ims):
        grid.paste(im, ((i % columns) * w, (i // columns) * h))
    grid.resize((columns * w * scale, rows * h * scale), Image.NEAREST).save(path)


def main(argv: list[str] | None = None) -> None:
    from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig

    ap = argparse.ArgumentParser(prog="python -m examples.shapes.evaluate", description=__doc__)
    ap.add_argument("--source", default="shapes-sd3", help="a preset name or a pipeline folder (an SFT export)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--guidance", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-sequence-length", type=int, default=32)
    ap.add_argument("--grid", default=None, help="write the samples as a PNG grid here")
    args = ap.parse_args(argv)
    bundle = DiffusionBundle.build(DiffusionModelConfig(source=args.source, finetune="full", reference_copy=False,
                                                        max_sequence_length=args.max_sequence_length))
    metrics, _, pngs = evaluate_model(bundle, num_prompts=args.prompts, num_steps=args.steps, shift=args.shift,
                                            guidance_scale=args.guidance, seed=args.seed)
    print(json.dumps({"source": args.source, "steps": args.steps, "shift": args.shift, "guidance": args.guidance,
                      "model": metrics, "renderer": renderer_ceiling(args.prompts)}, indent=1))
    if args.grid:
        save_grid(pngs, args.grid)


if __name__ == "__main__":
    main()
