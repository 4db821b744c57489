"""Trainside diffusion rollout vs a plain diffusers denoising loop, same transformer, batch and steps.

Ours: ``unirl_core.rollout.diffusion.denoise_slice`` - exactly what ``TrainsideDiffusionEngine`` runs per
forward slice: CFG forward, Flow-GRPO SDE kernel in fp32 on every step, per-sample recipe noise,
trajectory + log-prob + sigma recording. Baseline: the inner loop of ``StableDiffusion3Pipeline``
(``FlowMatchEulerDiscreteScheduler.step`` after the same CFG forward). Neither side encodes prompts or
decodes images (the transformer is the cost being compared). Result: throughput ratio ours / plain.

Presets:
  tiny   CPU, the tiny SD3 preset (2-layer MMDiT), 64 px, 10 steps, batch 8, fp32.
  sd35m  SD3.5-Medium-shaped transformer (24 layers, dual attention 0-12, random init), bf16,
         512 px, 10 steps, batches 8 and 32, random prompt embeddings of the real shapes.

  OMP_NUM_THREADS=1 python benchmarks/bench_diffusion_rollout.py --preset tiny
  python benchmarks/bench_diffusion_rollout.py --preset sd35m --device cuda
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import count_flops, fmt_mfu, matmul_peak_tflops, mfu_fields, report  # noqa: E402

from unirl_core.models.diffusion import DTYPES, DiffusionBundle, DiffusionModelConfig  # noqa: E402
from unirl_core.rollout.diffusion import denoise_slice  # noqa: E402
from unirl_core.sde import flow_sigmas, initial_noise, sde_noise_generators  # noqa: E402
from unirl_core.types import DiffusionSamplingParams, NoiseRecipe  # noqa: E402

SD35M = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
             num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
             pooled_projection_dim=2048, pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
             qk_norm="rms_norm")
PRESETS = {
    "tiny": dict(height=64, steps=10, sizes=(8,), dtype="float32", repeats=31),
    "sd35m": dict(height=512, steps=10, sizes=(8, 32), dtype="bfloat16", repeats=3),
}


def build(preset: str, device: str, dtype: str, layers: int | None = None, finetune: str = "full",
          lora_rank: int = 8) -> DiffusionBundle:
    from unirl_core.models.diffusion import LoRASpec

    cfg = DiffusionModelConfig(source="tiny-sd3" if preset == "tiny" else "sd35m-shaped", dtype=dtype, device=device,
                               finetune=finetune, reference_copy=False,
                               lora=LoRASpec(rank=lora_rank, alpha=2.0 * lora_rank))
    if preset == "tiny":
        return DiffusionBundle.build(cfg)
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    shape = dict(SD35M)
    if layers is not None:  # CPU smoke tests of the full-width model
        shape.update(num_layers=layers, dual_attention_layers=tuple(range(min(13, layers))))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])  # random init straight in bf16 on the device: no 10 GB fp32 detour
    try:
        with torch.device(device):
            transformer = SD3Transformer2DModel(**shape)
    finally:
        torch.set_default_dtype(prev)
    return DiffusionBundle.from_transformer(transformer, family="sd3", config=cfg)


def conditions(bundle: DiffusionBundle, preset: str, batch: int) -> dict[str, torch.Tensor]:
    """Batched CFG conditions: real prompt encodings (tiny) or random ones of SD3.5's shapes (77 + 256 tokens)."""
    if preset == "tiny":
        pos = bundle.encode_text([f"a photo of object {i}" for i in range(batch)])
        neg = bundle.encode_text([""])[0]
        conds = {k: torch.stack([c[k] for c in pos]) for k in pos[0]}
        conds.update({"negative_" + k: v.expand(batch, *v.shape).contiguous() for k, v in neg.items()})
    else:
        g = torch.Generator().manual_seed(0)
        conds = {}
        for prefix in ("", "negative_"):
            conds[prefix + "prompt_embeds"] = torch.randn(batch, 333, 4096, generator=g)
            conds[prefix + "pooled_prompt_embeds"] = torch.randn(batch, 2048, generator=g)
    return {k: v.to(bundle.device, bundle.dtype) for k, v in conds.items()}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def plain_loop(bundle: DiffusionBundle, conds, x_T: torch.Tensor, steps: int, guidance: float) -> torch.Tensor:
    """StableDiffusion3Pipeline's denoising loop, minus prompt encoding and decoding."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    transformer = bundle.module
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps, device=bundle.device)
    prompt = torch.cat([conds["negative_prompt_embeds"], conds["prompt_embeds"]])
    pooled = torch.cat([conds["negative_pooled_prompt_embeds"], conds["pooled_prompt_embeds"]])
    latents = x_T.to(bundle.device, bundle.dtype)
    for t in sched.timesteps:
        model_in = torch.cat([latents] * 2)
        v = transformer(hidden_states=model_in, timestep=t.expand(model_in.shape[0]), encoder_hidden_states=prompt,
                        pooled_projections=pooled, return_dict=False)[0]
        v_u, v_c = v.chunk(2)
        latents = sched.step(v_u + guidance * (v_c - v_u), t, latents, return_dict=False)[0]
    return latents


def ours(bundle: DiffusionBundle, conds, x_T: torch.Tensor, sampling: DiffusionSamplingParams, recipe: NoiseRecipe,
         mask: torch.Tensor | None = None):
    """``mask``: ``[num_steps]`` bool, the SDE steps (default all)."""
    b = x_T.shape[0]
    gens = sde_noise_generators(recipe, ["g"] * b, list(range(b)), bundle.device)
    steps = torch.ones(sampling.num_steps, dtype=torch.bool) if mask is None else mask
    mask = steps.unsqueeze(0).expand(b, -1).clone()
    return denoise_slice(bundle, sampling, x_T, conds, mask, gens, trajectory_dtype=bundle.dtype)


def timed_pair(plain, mine, device: str, repeats: int) -> tuple[float, float, float]:
    """Median seconds of each and the median of per-pair ratios plain / mine.

    The two run back to back in every repeat (order alternating), so load drift on a shared
    machine hits both alike; the per-pair ratio cancels most of what is left.
    """
    # On CPU (one pinned thread) the thread's CPU time ignores time spent descheduled by other
    # processes; on GPU wall time after a synchronize is the honest measure.
    clock = time.thread_time if device == "cpu" else time.perf_counter
    plain(), mine()  # warmup (kernels, allocator)
    sync(device)
    a, b = [], []
    for r in range(repeats):
        order = ((plain, a), (mine, b)) if r % 2 == 0 else ((mine, b), (plain, a))
        for fn, out in order:
            t0 = clock()
            fn()
            sync(device)
            out.append(clock() - t0)
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default=None, help="comma-separated batch sizes (default: the preset's)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--guidance", type=float, default=4.5)
    ap.add_argument("--layers", type=int, default=None, help="sd35m only: fewer layers (CPU smoke test)")
    ap.add_argument("--height", type=int, default=None, help="image size in pixels (default: the preset's)")
    ap.add_argument("--cfg-batch", choices=("joint", "split"), default="joint",
                    help="our side's diffusion.model.cfg_batch (the plain loop always batches [uncond; cond])")
    args = ap.parse_args()
    p = dict(PRESETS[args.preset])
    if args.height:
        p["height"] = args.height
    steps, repeats = args.steps or p["steps"], args.repeats or p["repeats"]
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else p["sizes"]
    if args.device == "cpu":
        torch.set_num_threads(1)
    bundle = build(args.preset, args.device, p["dtype"], args.layers)
    bundle.config = dataclasses.replace(bundle.config, cfg_batch=args.cfg_batch)
    sampling = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=steps, shift=3.0), guidance_scale=args.guidance,
                                       height=p["height"], width=p["height"])
    recipe = NoiseRecipe(base_seed=0)
    peak = matmul_peak_tflops(args.device)
    rows, data = [], []
    for b in sizes:
        conds = conditions(bundle, args.preset, b)
        x_T = initial_noise(recipe, ["g"] * b, bundle.latent_shape(p["height"], p["height"]))
        t_plain, t_ours, ratio = timed_pair(lambda c=conds, x=x_T: plain_loop(bundle, c, x, steps, args.guidance),
                                            lambda c=conds, x=x_T: ours(bundle, c, x, sampling, recipe), args.device,
                                            repeats)
        ips_plain, ips_ours = b * steps / t_plain, b * steps / t_ours
        # model FLOPs: one CFG forward of 2B rows per step (the plain loop's one step, counted, times the steps)
        flops = steps * count_flops(plain_loop, bundle, conds, x_T, 1, args.guidance)
        m_plain, m_ours = mfu_fields(flops, t_plain, peak), mfu_fields(flops, t_ours, peak)
        rows.append([args.preset, b, steps, f"{ips_plain:.1f}", f"{ips_ours:.1f}", f"{ratio:.3f}",
                     fmt_mfu(m_plain["mfu"]), fmt_mfu(m_ours["mfu"])])
        data.append({"preset": args.preset, "batch": b, "steps": steps, "height": p["height"], "dtype": p["dtype"],
                     "device": args.device, "plain_image_steps_per_s": ips_plain, "ours_image_steps_per_s": ips_ours,
                     "ratio": ratio, "plain_s": t_plain, "ours_s": t_ours, **m_ours, "plain_mfu": m_plain["mfu"]})
    cell = f"{args.preset}_{args.device.split(':')[0]}"
    if args.layers or args.height:
        cell += "_smoke"
    if args.cfg_batch != "joint":
        cell += f"_cfg-{args.cfg_batch}"
    report("diffusion_rollout", f"Diffusion rollout: trainside (SDE + recording) vs plain diffusers loop ({args.preset}, {args.device})",
           ["preset", "batch", "steps", "plain img-steps/s", "ours img-steps/s", "ours / plain", "plain MFU", "ours MFU"],
           rows, data,
           notes=f"Median of {repeats} interleaved runs after a warmup; ratio = median of per-pair time ratios; CFG scale {args.guidance} (ours: cfg_batch "
                 f"{args.cfg_batch}, joint = 2B rows per forward, split = two forwards of B); "
                 "ours records latents, fp32 Flow-GRPO log-probs and sigmas on every step. "
                 "CPU: OMP_NUM_THREADS=1, times are the thread's CPU time (the box is shared). Target: ours / plain >= 0.97. "
                 "MFU: the CFG forwards' model FLOPs (2B rows x steps, FlopCounterMode) over the median time and "
                 "this GPU's measured bf16 matmul peak (`-` on a CPU).", cell=cell)


if __name__ == "__main__":
    main()
