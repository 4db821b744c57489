"""The composed rollout of one step with bundles that already hold the stacks' weights: what the in-process
rollout phase (``compose.phases``) and the pool's engine actor (``compose.pool``) both run."""

from __future__ import annotations

import dataclasses
import time

from unirl_core.checkpoint import CheckpointRef
from unirl_core.compose.config import ComposeRunConfig, stack_configs
from unirl_core.compose.credit import image_batch
from unirl_core.compose.engine import compose_rollout
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.rollout.diffusion import TrainsideDiffusionEngine
from unirl_core.rollout.sigma_verify import verify_batch_sigmas
from unirl_core.runtime import build
from unirl_core.runtime.steps import EMA_POLICY_VERSION, step_prompts
from unirl_core.sde.noise import stable_seed
from unirl_core.types import NoiseRecipe, SampleBatch

Refs = dict[str, CheckpointRef]
"""``{"enhancer": ref, "image": ref}``: the version of each stack a phase works from."""


def sample_step(cfg: ComposeRunConfig, lm_policy, img_policy, refs: Refs, *,
                step: int) -> tuple[SampleBatch, dict[str, float]]:
    """The composed rollout of step ``step`` with bundles that already hold ``refs``' weights (the in-process
    phase loads them from the store; the pool's engine actor keeps them resident)."""
    t0 = time.perf_counter()
    subs = stack_configs(cfg)
    lm_sub, img_sub = subs["enhancer"], subs["image"]
    img_version = EMA_POLICY_VERSION if build.rollout_weights(img_sub) == "ema" else refs["image"].policy_version
    seed = stable_seed(cfg.loop.seed, "compose-rollout", step) % (2**63)
    enhancer = TrainsideAREngine(lm_policy, dataclasses.replace(lm_sub.lm.engine, seed=seed,
                                                                micro_batch_tokens=lm_sub.train.micro_batch_tokens),
                                 policy_version=refs["enhancer"].policy_version)
    image = TrainsideDiffusionEngine(img_policy, dataclasses.replace(img_sub.diffusion.engine, seed=seed),
                                     policy_version=img_version)
    sampling = img_sub.diffusion.sampling
    enhanced, batch = compose_rollout(
        enhancer, image, step_prompts(lm_sub, step), cfg.grouping, ar_sampling=lm_sub.lm.sampling,
        image_sampling=sampling.params(img_policy.family, step),
        noise=NoiseRecipe(base_seed=stable_seed(seed, "image"), same_noise_per_group=sampling.same_noise_per_group),
        image_version=img_version, metadata={"run": cfg.name, "step": str(step)})
    verify_batch_sigmas(image_batch(batch, cfg.grouping))
    lens = [s.generated.segment.num_response_tokens for s in enhanced.samples]
    metrics = {"rollout/samples": float(len(batch)), "rollout/enhancements": float(len(enhanced)),
               "rollout/enhancer_tokens_mean": sum(lens) / max(len(lens), 1),
               "rollout/seconds": time.perf_counter() - t0}
    if enhancer.last_decode_rescore_absdiff is not None:
        metrics["rollout/decode_rescore_absdiff_max"] = enhancer.last_decode_rescore_absdiff
    return batch, metrics
