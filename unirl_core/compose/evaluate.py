"""Deterministic evaluation of a compose run: does the enhancement beat the prompt itself?

Over the run's whole prompt set (held-in: the enhancer is judged on the prompts it trains on), each prompt is
enhanced greedily (``top_k=1``) by the enhancer's version and rendered ``images_per_prompt`` times by the image
stack's version with a fixed noise recipe; the same images are also rendered from the ORIGINAL prompt (the
"copy" baseline: what the image model does without an enhancer). Both are scored against the original prompt.
``eval/enhancement_gain`` = ``eval/reward/mean - eval/copy_reward/mean``.
"""

from __future__ import annotations

import dataclasses

from unirl_core.compose.config import ComposeRunConfig, stack_configs
from unirl_core.compose.eval_config import EVAL_SEED, ComposeEvalConfig
from unirl_core.compose.executor import compose_in_process
from unirl_core.runtime import build
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.rollout.diffusion import TrainsideDiffusionEngine
from unirl_core.types import NoiseRecipe, PromptRecord, SampleBatch


def _render(engine: TrainsideDiffusionEngine, records: list[PromptRecord], texts: dict[str, str], n: int, sampling,
            scorer) -> list[float]:
    """Render ``texts[prompt_id]`` n times per prompt (fixed noise), score against the original prompts."""
    req = SampleBatch.from_prompts(records, samples_per_prompt=n, kind="diffusion", sampling=sampling)
    cond = SampleBatch(samples=[dataclasses.replace(s, parts=[s.parts[0].copy(prompt=texts[s.group_id])])
                                for s in req.samples])
    out = engine.generate(cond, noise=NoiseRecipe(base_seed=EVAL_SEED))
    for o, s in zip(out.samples, req.samples):
        o.parts[0].prompt = s.parts[0].prompt
    scored, _ = scorer.score_with_stats(out)
    return [p.reward if p.reward is not None else 0.0 for p in scored.generated]


def evaluate_compose(cfg: ComposeRunConfig, refs, eval_cfg: ComposeEvalConfig) -> tuple[dict[str, float], dict]:
    """``eval/*`` metrics and ``{prompt: enhancement}`` of the versions in ``refs`` (greedy, fixed noise)."""
    subs = stack_configs(cfg)
    lm_sub, img_sub = subs["enhancer"], subs["image"]
    lm, img = compose_in_process().policies(cfg, refs)  # evaluation samples in this process, in every mode
    seen: dict[str, PromptRecord] = {}
    for r in build.dataset(lm_sub).records:
        seen.setdefault(r.prompt, PromptRecord(prompt_id=f"eval{len(seen):04d}", prompt=r.prompt, targets=r.targets))
    records = list(seen.values())
    greedy = dataclasses.replace(lm_sub.lm.sampling, top_k=1, seed=EVAL_SEED)
    enhancer = TrainsideAREngine(lm, lm_sub.lm.engine)
    enhanced = enhancer.generate(SampleBatch.from_prompts(records, samples_per_prompt=1, kind="ar", sampling=greedy))
    texts = {s.group_id: s.generated.text or "" for s in enhanced.samples}
    engine = TrainsideDiffusionEngine(img, img_sub.diffusion.engine)
    sampling = img_sub.diffusion.sampling.params(img.family, 1)
    scorer = build.reward_service(img_sub)
    n = eval_cfg.images_per_prompt
    ours = _render(engine, records, texts, n, sampling, scorer)
    copy = _render(engine, records, {r.prompt_id: r.prompt for r in records}, n, sampling, scorer)
    mean = sum(ours) / len(ours)
    base = sum(copy) / len(copy)
    exact = sum(texts[r.prompt_id] == r.prompt for r in records) / len(records)
    metrics = {"eval/reward/mean": mean, "eval/copy_reward/mean": base, "eval/enhancement_gain": mean - base,
               "eval/exact_copy_fraction": exact, "eval/prompts": float(len(records))}
    return metrics, {r.prompt: texts[r.prompt_id] for r in records}
