"""The eval phase: fixed held-out prompts, deterministic sampling, scored by the run's reward.

Diffusion samples with the Euler ODE (``sde_type: ode``) from a fixed NoiseRecipe (``eval.seed``), so the same
version always gives the same images; LMs decode greedily (``top_k: 1``, no stop change). The prompts are
``eval.prompts`` or, for generated prompt sets (``unirl_core.data.sources``: ``toy_arithmetic``, a plugin's such as
``shapes``), the same generator with another seed (``data.<section>.seed + HELD_OUT_SEED``), keeping only texts the training set does not contain. The weights are
the version's policy or its EMA (``eval.weights``). Metrics are ``eval/*``: the run report charts them, run_local
adds them to the step's record, the Flyte ``eval_task`` returns them to the report task.

Sampling always runs the trainside engine in this process (also for runs with a dedicated vLLM engine or in pool
mode), over batches of the engine's ``forward_batch_size``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Literal

from unirl_core.checkpoint import CheckpointRef
from unirl_core.loop import eval_cache
from unirl_core.errors import ConfigError, field_error
from unirl_core.types import NoiseRecipe, PromptRecord, SampleBatch

log = logging.getLogger(__name__)

HELD_OUT_SEED = 1_000_003
"""Offset of the prompt generator's seed for held-out eval prompts."""
EVAL_STEP_KEY = "eval"


def eval_prompts(cfg) -> list[PromptRecord]:
    """The fixed held-out prompts of the run (ids ``eval-00000``...)."""
    ev = cfg.eval
    if ev.prompts:
        return [PromptRecord(prompt_id=f"eval-{i:05d}", prompt=p) for i, p in enumerate(ev.prompts)]
    d = cfg.data  # an inline or file source has eval.prompts (check_eval_config)
    from unirl_core.data.sources import prompt_source

    gen = d.generator()
    draw = 4 * (ev.num_prompts + gen.num_prompts)
    recs = prompt_source(d.source).build(dataclasses.replace(gen, seed=gen.seed + HELD_OUT_SEED, num_prompts=draw))
    from unirl_core.runtime import build

    seen = {r.prompt for r in build.dataset(cfg).records}  # held out: no text the training stream can draw
    held = []
    for r in recs:
        if r.prompt not in seen:
            seen.add(r.prompt)
            held.append(r)
    if len(held) < ev.num_prompts:
        raise field_error(ConfigError, "eval.num_prompts", ev.num_prompts,
                          f"<= {len(held)} (distinct prompts of the generator outside the training set)",
                          "lower eval.num_prompts, or list eval.prompts")
    return [PromptRecord(prompt_id=f"eval-{i:05d}", prompt=r.prompt, targets=dict(r.targets))
            for i, r in enumerate(held[:ev.num_prompts])]


def eval_sampling(cfg, family: str):
    """Deterministic sampling params: the run's diffusion params with the ODE kernel, or greedy AR decoding."""
    if cfg.family == "diffusion":
        return dataclasses.replace(cfg.diffusion.sampling.params(family), sde_type="ode", sde_window_size=None,
                                   sde_window_range=None)
    return dataclasses.replace(cfg.lm.sampling, top_k=1, top_p=1.0, seed=None)


def eval_phase(cfg, ckpt: CheckpointRef, *, weights: Literal["policy", "ema"] | None = None,
               use_cache: bool = True) -> tuple[SampleBatch, dict[str, float]]:
    """Sample the held-out prompts deterministically with ``ckpt``'s (or its EMA) weights and score them.
    Returns the scored batch and ``eval/*`` metrics.

    Cached by content (``eval_cache``): the same weights (their digest) under the same protocol (prompts,
    sampling, reward, model, seed) are evaluated once per checkpoint root, whichever run and step hold them; a hit
    returns the stored batch and metrics (timings: this call's; the batch's metadata names the entry,
    ``eval_cached``). The batch's metadata carries ``weights_sha256`` and ``protocol_sha256``: the digests the
    numbers measured, which the run report's eval record keeps beside them. ``use_cache=False`` computes it anyway
    (and stores it)."""

    ev = cfg.eval
    if ev is None:
        raise field_error(ConfigError, "eval", None, "an eval section", "add eval: {every_n_steps: ...} to the recipe")
    weights = weights or ev.weights
    t0 = time.perf_counter()
    prompts = eval_prompts(cfg)
    digests = {"weights_sha256": eval_cache.weights_digest(cfg, ckpt, weights)}
    proto = eval_cache.protocol(cfg, prompts, weights)
    digests["protocol_sha256"] = eval_cache.digest_of(proto)
    key = eval_cache.digest_of(digests)
    cache = eval_cache.EvalCache(cfg.checkpoint.root, storage_options=cfg.checkpoint.storage_options)
    if use_cache and (hit := cache.get(key)) is not None:
        batch, record = hit
        # the numbers as measured; the timings are this call's (nothing was sampled)
        metrics = {**record["metrics"], "eval/sample_seconds": 0.0, "eval/seconds": time.perf_counter() - t0,
                   "eval/step": float(ckpt.step)}
        batch.metadata.update({"run": cfg.name, "step": str(ckpt.step), "eval_cached": record["key"], **digests})
        log.info("eval of %s: cached (weights %s, protocol %s; computed for %s)", ckpt.uri,
                 digests["weights_sha256"][:12], digests["protocol_sha256"][:12], record.get("uri"))
        return batch, metrics
    batch, metrics = _sample_and_score(cfg, ckpt, weights, prompts)
    metrics["eval/seconds"] = time.perf_counter() - t0
    batch.metadata.update(digests)
    cache.put(key, batch, {**digests, "metrics": metrics, "protocol": proto, "run": cfg.name, "step": ckpt.step,
                           "uri": ckpt.uri})
    return batch, metrics


def _sample_and_score(cfg, ckpt: CheckpointRef, weights: str,
                      prompts: list[PromptRecord]) -> tuple[SampleBatch, dict[str, float]]:
    """The evaluation itself: sample ``prompts`` with ``ckpt``'s weights, score them."""
    from unirl_core.runtime import build
    from unirl_core.loop.executors import in_process
    from unirl_core.loop.phases import EMA_POLICY_VERSION, reward_phase
    from unirl_core.runtime.steps import generate_lm
    from unirl_core.rollout.ar import TrainsideAREngine
    from unirl_core.rollout.diffusion import TrainsideDiffusionEngine

    ev = cfg.eval
    t0 = time.perf_counter()
    policy = in_process().resources.bundle(cfg)  # eval samples in this process, in every execution mode
    build.load_policy_weights(policy, ckpt, cfg, ema=weights == "ema")
    version = ckpt.policy_version if weights == "policy" else EMA_POLICY_VERSION
    sampling = eval_sampling(cfg, getattr(policy, "family", "sd3"))
    request = SampleBatch.from_prompts(prompts, samples_per_prompt=ev.samples_per_prompt,
                                       kind="diffusion" if cfg.family == "diffusion" else "ar", sampling=sampling,
                                       policy_version=version,
                                       metadata={"run": cfg.name, "step": str(ckpt.step), "phase": EVAL_STEP_KEY})
    if cfg.family == "diffusion":
        engine = TrainsideDiffusionEngine(policy, dataclasses.replace(cfg.diffusion.engine, seed=ev.seed),
                                          policy_version=version)
        batch = engine.generate(request, noise=NoiseRecipe(base_seed=ev.seed))
    else:
        engine = TrainsideAREngine(policy, dataclasses.replace(cfg.lm.engine, seed=ev.seed), policy_version=version)
        batch, _ = generate_lm(cfg, engine, request)
    sample_s = time.perf_counter() - t0
    batch, reward = reward_phase(cfg, batch)
    metrics = {f"eval/{k}": v for k, v in reward.items()
               if k.startswith("reward/") and not k.endswith("/seconds")}
    metrics.update({"eval/samples": float(len(batch)), "eval/sample_seconds": sample_s,
                    "eval/seconds": time.perf_counter() - t0, "eval/step": float(ckpt.step)})
    if cfg.family == "lm":
        lens = [p.segment.num_response_tokens for p in batch.generated]
        metrics["eval/response_tokens_mean"] = sum(lens) / max(len(lens), 1)
    return batch, metrics


def resolve_version(cfg, version: str = "latest") -> CheckpointRef:
    """A published version of ``cfg``'s run: ``latest`` or a version folder (URI or local path)."""
    from unirl_core.loop import resume
    from unirl_core.runtime import build

    store = build.store(cfg)
    if version in ("", "latest"):
        ref = store.latest()
        if ref is None:
            raise field_error(ConfigError, "version", version, f"a published version of run {cfg.name!r}",
                              f"{store.uri} holds none; train the run first or name another run")
        return ref
    return resume.find_version(store, version, cfg.name)
