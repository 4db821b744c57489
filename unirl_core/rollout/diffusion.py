"""Trainside diffusion engine: the training bundle itself samples, recording what replay needs.

For each forward slice of ``forward_batch_size`` samples it encodes the prompts (and the negative
prompt when CFG runs), draws x_T from the NoiseRecipe, runs the pinned schedule with the Part's SDE
kernel through ``unirl_core.sde.trajectory`` and fills each generated Part with the trajectory
(``DiffusionSegment``), per-sample replay conditions, PNG media and the policy version.
Flow-GRPO replay must use the same slicing (its ``replay_batch_size``) for bitwise-equal log-probs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, EngineError, field_error
from unirl_core.models.diffusion import COND_KEYS, DTYPES, NEG_PREFIX, DiffusionBundle, stack_conditions
from unirl_core.sde.noise import initial_noise, sde_noise_generators, sibling_indices, stable_seed
from unirl_core.sde.schedules import sigmas_tensor
from unirl_core.sde.trajectory import Trajectory, sample_trajectory
from unirl_core.sde.window import sde_step_mask
from unirl_core.types import DiffusionSamplingParams, DiffusionSegment, NoiseRecipe, Part, Sample, SampleBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DiffusionEngineConfig:
    """Trainside diffusion engine settings."""

    forward_batch_size: int = 8
    """Samples per transformer forward (CFG doubles the rows); bounds peak memory. Replay must match it."""
    trajectory_dtype: Literal["model", "float32", "bfloat16", "float16"] = "model"
    """Dtype of the stored latents; ``model`` uses the bundle's dtype."""
    seed: int = 0
    """Base seed of an engine-made NoiseRecipe when ``generate`` gets none (advanced per call)."""
    decode_media: bool = True
    """Decode x_0 to PNG bytes (the reward phase needs them)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.forward_batch_size, int) and self.forward_batch_size >= 1):
            raise field_error(ConfigError, "engine.forward_batch_size", self.forward_batch_size, "an integer >= 1",
                              "use e.g. 8 and lower it when the GPU runs out of memory")
        if self.trajectory_dtype != "model" and self.trajectory_dtype not in DTYPES:
            raise field_error(ConfigError, "engine.trajectory_dtype", self.trajectory_dtype,
                              f"'model' or one of {tuple(DTYPES)}", "store latents in the model dtype")


def sde_masks(batch: SampleBatch, sampling: DiffusionSamplingParams, recipe: NoiseRecipe) -> Tensor:
    """``[N, T]`` SDE-step masks; siblings of a group share one window (drawn from the recipe)."""
    rows, cache = [], {}
    for s in batch.samples:
        if s.group_id not in cache:
            gen = torch.Generator().manual_seed(stable_seed(recipe.base_seed, s.group_id, "sde-window"))
            cache[s.group_id] = sde_step_mask(sampling, generator=gen)
        rows.append(cache[s.group_id])
    return torch.stack(rows)


def denoise_slice(bundle: DiffusionBundle, sampling: DiffusionSamplingParams, x_T: Tensor, conds: dict[str, Tensor],
                  sde_mask: Tensor, generators: list[torch.Generator], *, trajectory_dtype: torch.dtype) -> Trajectory:
    """The engine's inner loop for one forward slice (also what the rollout benchmark times).

    ``x_T`` ``[B, C, h, w]``, batched ``conds`` on the bundle's device, ``sde_mask`` ``[B, T]``,
    one SDE-noise generator per sample (on the bundle's device).
    """
    device = bundle.device
    sig = sigmas_tensor(sampling.sigmas, device)
    prepared = bundle.prepare_cfg(conds, guidance_scale=sampling.guidance_scale)
    # All steps' SDE noise up front: one draw per sample instead of one per sample and step.
    noise = torch.stack([torch.randn((sampling.num_steps, *x_T.shape[1:]), generator=g, device=device,
                                     dtype=torch.float32) for g in generators], dim=1)

    def velocity_fn(x: Tensor, sigma: Tensor) -> Tensor:
        return bundle.guided_velocity(x, sigma, prepared, guidance_scale=sampling.guidance_scale)

    def noise_fn(k: int) -> Tensor:
        return noise[k]

    was_training = bundle.module.training
    bundle.module.eval()
    try:
        # One cast of the parameters for the whole slice (velocity's own compute() then swaps nothing).
        with bundle.compute():
            return sample_trajectory(velocity_fn, x_T.to(device), sig, sde_type=sampling.sde_type,
                                     noise_level=sampling.noise_level, sde_mask=sde_mask.cpu(),
                                     trajectory_dtype=trajectory_dtype, noise_fn=noise_fn)
    finally:
        bundle.module.train(was_training)


class TrainsideDiffusionEngine:
    """``RolloutEngine`` over a ``DiffusionBundle`` in this process (no weight sync needed)."""

    def __init__(self, bundle: DiffusionBundle, config: DiffusionEngineConfig | None = None, *,
                 policy_version: int = 0) -> None:
        self.bundle = bundle
        self.config = config or DiffusionEngineConfig()
        self.policy_version = policy_version
        self._calls = 0
        tdt = self.config.trajectory_dtype
        self.trajectory_dtype = bundle.dtype if tdt == "model" else DTYPES[tdt]

    def generate(self, batch: SampleBatch, *, noise: NoiseRecipe | None = None,
                 noise_index: list[int] | None = None) -> SampleBatch:
        """Fill every generated diffusion Part; returns a new batch in the same order.

        ``noise_index``: which draw of its group's noise (x_T and SDE stream) each sample takes; default its
        position among its group's samples in batch order. Prompt enhancement passes the image index, so image j
        of every enhancement of a prompt renders from the same noise (``grouping.image_noise: paired``)."""
        if not len(batch):
            return SampleBatch(samples=[], metadata=dict(batch.metadata))
        sampling = self._common_sampling(batch)
        if noise is None:
            noise = NoiseRecipe(base_seed=stable_seed(self.config.seed, "engine-call", self._calls))
        self._calls += 1
        start = time.perf_counter()
        shape = self.bundle.latent_shape(sampling.height, sampling.width)
        group_ids = [s.group_id for s in batch.samples]
        sib = sibling_indices(group_ids) if noise_index is None else list(noise_index)
        if len(sib) != len(group_ids):
            raise field_error(EngineError, "noise_index", len(sib), f"one index per sample ({len(group_ids)})",
                              "pass the draw index of every request")
        x_T = initial_noise(noise, group_ids, shape, sib)
        masks = sde_masks(batch, sampling, noise)
        conds = self._conditions(batch, sampling)
        out: list[Sample] = []
        size = self.config.forward_batch_size
        for lo in range(0, len(batch), size):
            idx = list(range(lo, min(lo + size, len(batch))))
            out.extend(self._run_slice(batch, idx, sampling, x_T[lo:idx[-1] + 1], masks[lo:idx[-1] + 1],
                                       [conds[i] for i in idx], noise, [group_ids[i] for i in idx],
                                       [sib[i] for i in idx]))
        elapsed = time.perf_counter() - start
        logger.info("diffusion rollout: %d samples x %d steps in %.2fs (%.1f image-steps/s)", len(batch),
                    sampling.num_steps, elapsed, len(batch) * sampling.num_steps / max(elapsed, 1e-9))
        return SampleBatch(samples=out, metadata=dict(batch.metadata))

    # -- pieces -------------------------------------------------------------------------------
    def _common_sampling(self, batch: SampleBatch) -> DiffusionSamplingParams:
        first = None
        for s in batch.samples:
            part = s.generated
            if part.kind != "diffusion" or not isinstance(part.sampling, DiffusionSamplingParams):
                raise field_error(EngineError, f"sample[{s.sample_id}].generated", (part.kind, type(part.sampling).__name__),
                                  "a 'diffusion' Part with pinned DiffusionSamplingParams",
                                  "build requests with SampleBatch.from_prompts(kind='diffusion', sampling=...)")
            if first is None:
                first = part.sampling
            elif part.sampling != first:
                raise field_error(EngineError, f"sample[{s.sample_id}].sampling", part.sampling,
                                  f"the same sampling params as the first sample ({first})",
                                  "this engine runs one schedule per batch; split the batch by sampling params")
        return first

    def _conditions(self, batch: SampleBatch, sampling: DiffusionSamplingParams) -> list[dict[str, Tensor]]:
        prompts = [conditioning_prompt(s) for s in batch.samples]
        unique = list(dict.fromkeys(prompts))
        encoded = dict(zip(unique, self.bundle.encode_text(unique)))
        neg = None
        if self.bundle.guidance_uses_negative(sampling.guidance_scale):
            neg = self.bundle.encode_text([sampling.negative_prompt])[0]
        out = []
        for p in prompts:
            c = {k: v.detach().to("cpu").clone() for k, v in encoded[p].items()}
            if neg is not None:
                c.update({NEG_PREFIX + k: neg[k].detach().to("cpu").clone() for k in COND_KEYS})
            out.append(c)
        return out

    def _run_slice(self, batch: SampleBatch, idx: list[int], sampling: DiffusionSamplingParams, x_T: Tensor,
                   masks: Tensor, conds: list[dict[str, Tensor]], recipe: NoiseRecipe, group_ids: list[str],
                   sib: list[int]) -> list[Sample]:
        bundle = self.bundle
        gens = sde_noise_generators(recipe, group_ids, sib, bundle.device)
        traj = denoise_slice(bundle, sampling, x_T, stack_conditions(conds, bundle.device), masks, gens,
                             trajectory_dtype=self.trajectory_dtype)
        media = bundle.decode_png(traj.latents[:, -1]) if self.config.decode_media else [None] * len(idx)
        used = traj.sigmas_used.cpu()
        filled = []
        for j, i in enumerate(idx):
            seg = DiffusionSegment(latents=traj.latents[j].cpu().contiguous(), log_probs=traj.log_probs[j].cpu().clone(),
                                   sigmas=used.clone(), sde_mask=masks[j].cpu().clone())
            filled.append(_with_generated(batch.samples[i], seg=seg, conds=conds[j], media=media[j],
                                          version=self.policy_version))
        return filled


def conditioning_prompt(sample: Sample) -> str:
    """The text a diffusion Part is conditioned on: its parent Part's output text when it has one
    (prompt enhancement: an AR Part rewrites the prompt; an empty completion conditions on ""), else its own prompt."""
    part = sample.generated
    if part.parent is not None:
        parent = sample.parts[part.parent]
        if parent.text is not None and (parent.text or parent.segment is not None):
            return parent.text
        if parent.kind == "ar":
            raise field_error(EngineError, f"sample[{sample.sample_id}].parts[{part.parent}].text", parent.text,
                              "the parent AR Part's completion", "run the AR stage before the diffusion stage")
    return part.prompt


def _with_generated(sample: Sample, *, seg: DiffusionSegment, conds: dict[str, Tensor], media: bytes | None,
                    version: int) -> Sample:
    new = sample.copy()
    parts: list[Part] = new.parts
    k = max(i for i, p in enumerate(parts) if p.kind != "input")
    parts[k] = parts[k].copy(segment=seg, conditions=conds, media=media, policy_version=version)
    return new
