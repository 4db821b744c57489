"""A Flow-GRPO train step through the shipped path vs a reference-style training loop, every step trained.

Ours: ``TrainBackend.step`` on a rollout micro-batch (FlowGRPO.loss_terms: one trained step's forward and
backward at a time, CFG uncond branch detached, the model natively in bf16 over fp32 LoRA masters), then
clip + AdamW. Baseline, measured in the same run on its own copy of the same weights: the training loop of
the public Flow-GRPO repository as its code describes it (``scripts/train_sd3.py``): under bf16 autocast
with fp32 LoRA weights, per trained timestep one CFG forward of 2B rows (uncond detached), the SDE step's
log-prob, the clipped surrogate (+ KL against the adapter-disabled model under no_grad) and an immediate
``backward``; after the last timestep clip + AdamW. Both train all 10 steps of a 10-step, 512 px, CFG 4.5
trajectory of the SD3.5-Medium-shaped transformer (random init, LoRA r32 / alpha 64, like sd35m-pickscore).

Ours runs once per ``diffusion.model.cfg_batch`` layout (``--cfg-batch``, each rolling out its own batch):
``joint`` is the reference's layout (one forward of 2B rows, backward through all of them); ``split`` runs the
two branches as forwards of B rows, the unconditional one without autograd (its gradient is stopped anyway), so
the backward covers B rows. ``--cuda-graphs never,always`` adds a row per layout with
``diffusion.model.cuda_graphs: always`` (the sd35m recipes' ``auto`` on one GPU): the loss forward and its
backward as CUDA graph replays; that side's peak includes the graphs' resident memory pool.

What the baseline does not do that ours does: record per-entry metrics (ratio, dlogp, KL), check the
first-update exactness, run the FSDP-ready gradient-sync bookkeeping. What ours does not do: autocast.

  python benchmarks/bench_flow_grpo_step.py --device cuda                 # mb 4 and 8
  python benchmarks/bench_flow_grpo_step.py --cfg-batch joint --cuda-graphs never,always  # eager and graphed
  OMP_NUM_THREADS=1 python benchmarks/bench_flow_grpo_step.py --preset tiny  # CPU smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_diffusion_replay import micro_batch  # noqa: E402
from bench_diffusion_rollout import build, sync  # noqa: E402
from common import matmul_peak_tflops, report  # noqa: E402

from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig, gaussian_kl_same_std  # noqa: E402
from unirl_core.models.cuda_graphs import graph_pool_bytes  # noqa: E402
from unirl_core.models.lora import lora_disabled  # noqa: E402
from unirl_core.models.precision import upcast_trainable  # noqa: E402
from unirl_core.sde import flow_sigmas  # noqa: E402
from unirl_core.sde.kernels import flow_mean_std, gaussian_log_prob  # noqa: E402
from unirl_core.train import TrainBackend, TrainConfig  # noqa: E402
from unirl_core.types import DiffusionSamplingParams  # noqa: E402

CLIP, BETA, LR, G = 1e-4, 0.01, 3e-4, 4.5


class ReferenceLoop:
    """The reference training loop's step (see the module docstring), on its own copy of the transformer."""

    def __init__(self, bundle, batch, steps: list[int]) -> None:
        self.module = bundle.module
        upcast_trainable(self.module)  # fp32 LoRA weights, as the reference casts its trainable parameters
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=1e-4)
        dev = bundle.device
        parts = batch.generated
        self.lat = torch.stack([p.segment.latents for p in parts]).to(dev)
        self.old = torch.stack([p.segment.log_probs for p in parts]).to(dev)
        self.adv = torch.tensor([p.advantage for p in parts], device=dev).clamp(-5, 5)
        cat = lambda key: torch.cat([torch.stack([p.conditions[f"negative_{key}"] for p in parts]),  # noqa: E731
                                     torch.stack([p.conditions[key] for p in parts])]).to(dev)
        self.prompt, self.pooled = cat("prompt_embeds"), cat("pooled_prompt_embeds")
        self.sig = parts[0].segment.sigmas.to(dev)
        self.steps, self.dev = steps, dev

    def velocity(self, x, k: int):
        with torch.autocast(self.dev.type, dtype=torch.bfloat16):
            v = self.module(hidden_states=torch.cat([x, x]), timestep=(self.sig[k] * 1000).expand(2 * x.shape[0]),
                            encoder_hidden_states=self.prompt, pooled_projections=self.pooled, return_dict=False)[0]
        v_u, v_c = v.float().chunk(2)
        v_u = v_u.detach()
        return v_u + G * (v_c - v_u)

    def step(self) -> None:
        for k in self.steps:
            x, nxt = self.lat[:, k].float(), self.lat[:, k + 1].float()
            mean, std = flow_mean_std(self.velocity(x, k), x, self.sig[k], self.sig[k + 1], noise_level=0.7,
                                      sigma_cap=self.sig[1])
            lp = gaussian_log_prob(nxt, mean, std)
            ratio = torch.exp(lp - self.old[:, k])
            loss = torch.maximum(-self.adv * ratio, -self.adv * ratio.clamp(1 - CLIP, 1 + CLIP)).mean()
            with torch.no_grad(), lora_disabled(self.module):
                ref_mean, _ = flow_mean_std(self.velocity(x, k), x, self.sig[k], self.sig[k + 1], noise_level=0.7,
                                            sigma_cap=self.sig[1])
            loss = loss + BETA * gaussian_kl_same_std(mean, ref_mean, std.expand(x.shape[0], 1, 1, 1)).mean()
            (loss / len(self.steps)).backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def peak_of(fn, device: str) -> float:
    if not device.startswith("cuda"):
        fn()
        return float("nan")
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def profile_sides(order, device: str, out: Path, b: int) -> None:
    """One step of each side under torch.profiler: where a side's wall time goes (kernels vs the host)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    keys = (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]
    lines = []
    for name, fn in order:
        sync(device)
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            fn()
            sync(device)
        wall = time.perf_counter() - t0
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy = sum(e.device_time_total for e in kernels) / 1e6
        lines.append(f"mb {b} {name}: wall {wall:.3f} s (profiled), kernels {len(kernels)}, summed kernel time "
                     f"{busy:.3f} s ({busy / wall:.0%} of wall)")
        ka = prof.key_averages()
        for key in keys:
            (out / f"mb{b}_{name}_{key}.txt").write_text(ka.table(sort_by=key, row_limit=45, max_name_column_width=70))
    (out / f"mb{b}_summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("tiny", "sd35m"), default="sd35m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default=None, help="micro-batch sizes (default 4,8; tiny: 4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing on both sides")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--cfg-batch", default="joint,split",
                    help="our side's diffusion.model.cfg_batch layouts, each its own row (default joint,split)")
    ap.add_argument("--cuda-graphs", default="never",
                    help="our side's diffusion.model.cuda_graphs values, each its own row (e.g. never,always)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed pairs, one more step of each side under torch.profiler: per-side tables "
                         "of the top ops by device and by CPU time, and wall vs summed kernel time, in DIR")
    args = ap.parse_args()
    tiny = args.preset == "tiny"
    if args.device == "cpu":
        torch.set_num_threads(1)
    dtype = "float32" if tiny else "bfloat16"
    height = args.height or (64 if tiny else 512)
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else ((4,) if tiny else (4, 8))
    rollout = build(args.preset, args.device, dtype, args.layers, finetune="lora", lora_rank=32)
    sampling = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=10), guidance_scale=G, height=height,
                                       width=height, noise_level=0.7)
    modes = tuple(f"{c}+graphs" if g == "always" else c for c in args.cfg_batch.split(",")
                  for g in args.cuda_graphs.split(","))
    rows, data = [], []
    peak_tflops = matmul_peak_tflops(args.device)
    for b in sizes:
        ref_bundle = copy.deepcopy(rollout)
        sides, firsts, pools = {}, {}, {}
        batches: dict[str, object] = {}
        for mode in modes:  # each layout rolls out its own batch: rollout and replay share cfg_batch
            layout, graphs = mode.split("+")[0], "always" if mode.endswith("+graphs") else "never"
            rollout.config = dataclasses.replace(rollout.config, cfg_batch=layout)
            if layout not in batches:
                batches[layout] = micro_batch(rollout, args.preset, b, sampling)
            batch = batches[layout]
            algo = FlowGRPO(FlowGRPOConfig(replay_batch_size=b, clip_range=CLIP, kl_beta=BETA, adv_clip_max=5.0))
            steps = algo._train_steps(batch, [p.segment for p in batch.generated])
            assert len(steps) == 10, steps
            bnd = copy.deepcopy(rollout)
            bnd.config = dataclasses.replace(bnd.config, cuda_graphs=graphs)
            if args.grad_ckpt:
                bnd.module.enable_gradient_checkpointing()
            bnd.module.train()
            backend = TrainBackend(bnd, algo, TrainConfig(lr=LR, weight_decay=1e-4, micro_batch_size=b,
                                                          max_grad_norm=1.0))
            pool0 = graph_pool_bytes()
            firsts[mode] = backend.step(batch).metrics  # first update: the exactness contract at this shape
            # A graphed side keeps one forward's activations in its graphs' pool for good: count it in its peak.
            pools[mode] = (graph_pool_bytes() - pool0) / 2**30
            if graphs == "always":
                assert bnd.train_graphs is not None and bnd.train_graphs.replays > 0, "the graphs were not used"
            sides[mode] = functools.partial(lambda be, bt: be.step(bt), backend, batch)
            if mode == modes[0]:
                ref_batch = batch
        if args.grad_ckpt:
            ref_bundle.module.enable_gradient_checkpointing()
        ref_bundle.module.train()
        ref = ReferenceLoop(ref_bundle, ref_batch, steps)
        ref.step()
        peaks = {"reference": peak_of(ref.step, args.device)}
        peaks.update({mode: peak_of(fn, args.device) + pools[mode] for mode, fn in sides.items()})
        clock = time.thread_time if args.device == "cpu" else time.perf_counter
        order = [("reference", ref.step), *sides.items()]
        times: dict[str, list[float]] = {name: [] for name, _ in order}
        for r in range(args.repeats):
            for name, fn in order[r % len(order):] + order[:r % len(order)]:  # rotate who goes first
                sync(args.device)
                t0 = clock()
                fn()
                sync(args.device)
                times[name].append(clock() - t0)
        if args.profile:
            profile_sides(order, args.device, Path(args.profile), b)
        # MFU: the algorithm's model FLOPs (the reference step, counted op by op: CFG forwards of 2B rows, the
        # backward, the KL reference forward) over each side's median step time and this GPU's bf16 matmul peak
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            ref.step()
        flops = counter.get_total_flops()
        a = times["reference"]
        med_a = statistics.median(a)
        mfu = (lambda t: flops / (t * peak_tflops * 1e12)) if peak_tflops else (lambda t: float("nan"))
        for mode in modes:
            o, first = times[mode], firsts[mode]
            ratio = statistics.median(x / y for x, y in zip(o, a))  # ours / reference time, per pair
            med_o = statistics.median(o)
            rows.append([b, mode, f"{med_a:.3f}", f"{med_o:.3f}", f"{med_o / med_a:.3f}", f"{ratio:.3f}",
                         f"{peaks['reference']:.1f}", f"{peaks[mode]:.1f}",
                         f"{first['ratio_min']:.9g}..{first['ratio_max']:.9g}", f"{first['logp_absdiff_max']:.3g}",
                         f"{mfu(med_a):.1%}", f"{mfu(med_o):.1%}"])
            data.append({"micro_batch": b, "cfg_batch": mode, "trained_steps": len(steps), "height": height,
                         "grad_ckpt": args.grad_ckpt, "reference_s": med_a, "ours_s": med_o,
                         "graph_pool_gib": pools[mode], "ratio_of_medians": med_o / med_a, "median_pair_ratio": ratio,
                         "reference_peak_gib": peaks["reference"], "ours_peak_gib": peaks[mode],
                         "first_update_ratio_min": first["ratio_min"], "first_update_ratio_max": first["ratio_max"],
                         "logp_absdiff_max": first["logp_absdiff_max"], "reference_times": a, "ours_times": o,
                         "model_flops_per_step": flops, "peak_tflops": peak_tflops,
                         "reference_mfu": mfu(med_a), "mfu": mfu(med_o)})
        del sides, ref, ref_bundle
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    cell = f"{args.preset}_{args.device.split(':')[0]}" + ("_ckpt" if args.grad_ckpt else "")
    if args.layers or args.height:
        cell += "_smoke"
    report("flow_grpo_step", f"Flow-GRPO train step, all 10 steps trained: TrainBackend vs reference-style loop ({args.preset})",
           ["micro-batch", "ours cfg_batch", "reference s", "ours s", "ours/ref (medians)", "ours/ref (median of pairs)",
            "reference peak GiB", "ours peak GiB", "first-update ratio", "max abs dlogp", "reference MFU", "ours MFU"],
           rows, data,
           notes=f"Median of {args.repeats} interleaved pairs after a warmup step each; peak = max allocated during "
                 "one step minus what was allocated before it (both sides hold the same resident models), plus a "
                 "graphed side's graph pool (``+graphs``: diffusion.model.cuda_graphs always; its resident "
                 "activations). "
                 "LoRA r32, CFG 4.5, KL beta 0.01, clip 1e-4, 512 px unless --height. Target: ours/ref <= 0.9, "
                 "peak <= reference. MFU: the reference step's model FLOPs (torch's FlopCounterMode) over the side's "
                 "median step time and this GPU's bf16 matmul peak measured in the same run.", cell=cell)


if __name__ == "__main__":
    main()
