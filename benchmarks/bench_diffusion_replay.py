"""Flow-GRPO replay forward+backward vs a plain forward+backward of the same transformer.

Ours: ``FlowGRPO.loss`` on one micro-batch of stored trajectories (stacking stored latents and
conditions, CFG forward per trained step, fp32 SDE kernel and log-prob, clipped surrogate) and
``backward``. Plain: the same number of CFG forwards of the same module on the same latents and
conditions with a trivial loss, and ``backward``. Result: throughput ratio ours / plain.

Presets (see bench_diffusion_rollout.py for the models):
  tiny   CPU, tiny SD3 preset, LoRA, 64 px, 10 steps all trained, micro-batch 8, fp32.
  sd35m  SD3.5-Medium-shaped transformer, full fine-tune (no peft needed), bf16, 512 px, 10 steps of which 1 trained
         (the graph of every trained step is kept until backward), micro-batches 4 and 8.

  OMP_NUM_THREADS=1 python benchmarks/bench_diffusion_replay.py --preset tiny
  python benchmarks/bench_diffusion_replay.py --preset sd35m --device cuda
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_diffusion_rollout import build, conditions, sync, timed_pair  # noqa: E402
from bench_diffusion_rollout import ours as rollout_slice
from common import count_flops, fmt_mfu, matmul_peak_tflops, mfu_fields, report, without_recompute  # noqa: E402

from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig  # noqa: E402
from unirl_core.sde import flow_sigmas, initial_noise  # noqa: E402
from unirl_core.types import (  # noqa: E402
    DiffusionSamplingParams,
    DiffusionSegment,
    NoiseRecipe,
    Part,
    Sample,
    SampleBatch,
)

PRESETS = {
    "tiny": dict(height=64, steps=10, train_steps=10, sizes=(8,), dtype="float32", repeats=21, finetune="lora"),
    # full fine-tune by default so the GPU run needs no peft (torch + transformers + diffusers only)
    "sd35m": dict(height=512, steps=10, train_steps=1, sizes=(4, 8), dtype="bfloat16", repeats=3, finetune="full"),
}


def micro_batch(bundle, preset: str, b: int, sampling: DiffusionSamplingParams,
                sde_steps: list[int] | None = None) -> SampleBatch:
    """A filled micro-batch: trajectories from the engine's inner loop, per-sample conditions on the Parts.

    ``sde_steps``: the denoising steps that are SDE steps (the rest ODE, as in a MixGRPO window); default all.
    """
    conds = conditions(bundle, preset, b)
    recipe = NoiseRecipe(base_seed=0)
    x_T = initial_noise(recipe, ["g"] * b, bundle.latent_shape(sampling.height, sampling.width))
    step_mask = torch.ones(sampling.num_steps, dtype=torch.bool)
    if sde_steps is not None:
        step_mask = torch.zeros(sampling.num_steps, dtype=torch.bool)
        step_mask[sde_steps] = True
    traj = rollout_slice(bundle, conds, x_T, sampling, recipe, mask=step_mask)
    samples = []
    for i in range(b):
        seg = DiffusionSegment(latents=traj.latents[i].contiguous(), log_probs=traj.log_probs[i].cpu(),
                               sigmas=traj.sigmas_used.cpu(), sde_mask=step_mask.clone())
        part = Part(kind="diffusion", sample_id=f"s{i}", group_id="g", sampling=sampling, segment=seg,
                    conditions={k: v[i] for k, v in conds.items()}, advantage=float(i % 2) * 2 - 1)
        samples.append(Sample(sample_id=f"s{i}", group_id="g", parts=[part]))
    return SampleBatch(samples=samples)


def plain_fwd_bwd(bundle, mb: SampleBatch, steps: list[int], guidance: float) -> None:
    """The same CFG forwards (batch 2B, same inputs) with a trivial loss, then backward."""
    parts = mb.generated
    lat = torch.stack([p.segment.latents for p in parts]).to(bundle.device)
    prompt = torch.cat([torch.stack([p.conditions[f"{pre}prompt_embeds"] for p in parts])
                        for pre in ("negative_", "")]).to(bundle.device)
    pooled = torch.cat([torch.stack([p.conditions[f"{pre}pooled_prompt_embeds"] for p in parts])
                        for pre in ("negative_", "")]).to(bundle.device)
    sig = parts[0].segment.sigmas.to(bundle.device)
    loss = 0.0
    for k in steps:
        x = lat[:, k].to(bundle.dtype)
        v = bundle.module(hidden_states=torch.cat([x, x]), timestep=(sig[k] * 1000).expand(2 * x.shape[0]),
                          encoder_hidden_states=prompt, pooled_projections=pooled, return_dict=False)[0]
        v_u, v_c = v.float().chunk(2)
        loss = loss + (v_u + guidance * (v_c - v_u)).square().mean()
    loss.backward()
    bundle.module.zero_grad(set_to_none=True)


def model_flops(bundle, mb: SampleBatch, steps: list[int], guidance: float) -> float:
    """The CFG forwards (2B rows per trained step) and their backward, counted on one sample without recomputation
    and scaled to the micro-batch (one sample's activations fit where the micro-batch's need checkpointing)."""
    with without_recompute(bundle.module):
        return len(mb.samples) * count_flops(plain_fwd_bwd, bundle, SampleBatch(samples=mb.samples[:1]), steps,
                                             guidance)


def ours_fwd_bwd(bundle, algo: FlowGRPO, mb: SampleBatch) -> None:
    algo.loss(bundle, mb, old_log_probs=None).loss.backward()
    bundle.module.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default=None, help="comma-separated micro-batch sizes (default: the preset's)")
    ap.add_argument("--train-steps", type=int, default=None, help="trained steps per micro-batch")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--finetune", choices=("lora", "full"), default=None, help="default: the preset's")
    ap.add_argument("--guidance", type=float, default=4.5)
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (both sides: same module)")
    ap.add_argument("--layers", type=int, default=None, help="sd35m only: fewer layers (CPU smoke test)")
    ap.add_argument("--height", type=int, default=None)
    args = ap.parse_args()
    p = dict(PRESETS[args.preset])
    if args.height:
        p["height"] = args.height
    args.finetune = args.finetune or p["finetune"]
    train_steps, repeats = args.train_steps or p["train_steps"], args.repeats or p["repeats"]
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else p["sizes"]
    if args.device == "cpu":
        torch.set_num_threads(1)
    bundle = build(args.preset, args.device, p["dtype"], args.layers, finetune=args.finetune)
    if args.grad_ckpt:
        bundle.module.enable_gradient_checkpointing()
    bundle.module.train()
    steps = p["steps"]
    sampling = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=steps), guidance_scale=args.guidance,
                                       height=p["height"], width=p["height"])
    peak = matmul_peak_tflops(args.device)
    rows, data = [], []
    for b in sizes:
        mb = micro_batch(bundle, args.preset, b, sampling)
        algo = FlowGRPO(FlowGRPOConfig(replay_batch_size=b, timestep_fraction=train_steps / steps))
        chosen = algo._train_steps(mb, [q.segment for q in mb.generated])
        assert len(chosen) == train_steps, chosen
        # No optimizer step ever runs here, so every loss call is a "first update": the exactness
        # contract says ratio exactly 1 and |logp_rollout - logp_replay| exactly 0, on this device too.
        exact = algo.loss(bundle, mb, old_log_probs=None).metrics
        bundle.module.zero_grad(set_to_none=True)
        t_plain, t_ours, ratio = timed_pair(lambda mb=mb, chosen=chosen: plain_fwd_bwd(bundle, mb, chosen, args.guidance),
                                            lambda mb=mb, algo=algo: ours_fwd_bwd(bundle, algo, mb), args.device, repeats)
        flops = model_flops(bundle, mb, chosen, args.guidance)
        m_plain, m_ours = mfu_fields(flops, t_plain, peak), mfu_fields(flops, t_ours, peak)
        rows.append([args.preset, args.finetune + ("+ckpt" if args.grad_ckpt else ""), b, train_steps,
                     f"{t_plain * 1e3:.1f}", f"{t_ours * 1e3:.1f}", f"{ratio:.3f}",
                     f"{exact['ratio_min']:.9g}..{exact['ratio_max']:.9g}", f"{exact['logp_absdiff_max']:.3g}",
                     fmt_mfu(m_plain["mfu"]), fmt_mfu(m_ours["mfu"])])
        data.append({"preset": args.preset, "finetune": args.finetune, "grad_ckpt": args.grad_ckpt, "micro_batch": b,
                     "trained_steps": train_steps,
                     "height": p["height"], "dtype": p["dtype"], "device": args.device, "plain_s": t_plain,
                     "ours_s": t_ours, "ratio": ratio, "first_update_ratio_min": exact["ratio_min"],
                     "first_update_ratio_max": exact["ratio_max"], "logp_absdiff_max": exact["logp_absdiff_max"],
                     **m_ours, "plain_mfu": m_plain["mfu"]})
    sync(args.device)
    cell = f"{args.preset}_{args.device.split(':')[0]}"
    if args.layers or args.height:
        cell += "_smoke"
    report("diffusion_replay", f"Flow-GRPO replay fwd+bwd vs plain fwd+bwd of the same transformer ({args.preset}, {args.device})",
           ["preset", "finetune", "micro-batch", "trained steps", "plain ms", "ours ms", "ours / plain (throughput)",
            "first-update ratio", "max abs dlogp", "plain MFU", "ours MFU"],
           rows, data,
           notes=f"Median of {repeats} interleaved runs after a warmup; ratio = median of per-pair time ratios; CFG scale {args.guidance} (2B rows per "
                 "forward). The last two columns check the exactness contract on this device (rollout by the engine's "
                 "inner loop in eval/no-grad, replay in train mode with grad): expected exactly 1 and 0. "
                 "CPU: OMP_NUM_THREADS=1, times are the thread's CPU time (the box is shared). Target: >= 0.95. "
                 "MFU: the CFG forwards' and backward's model FLOPs (FlopCounterMode, no recomputation; LoRA: no "
                 "weight gradients of the frozen base) over the median time and this GPU's measured bf16 matmul "
                 "peak (`-` on a CPU).", cell=cell)


if __name__ == "__main__":
    main()
