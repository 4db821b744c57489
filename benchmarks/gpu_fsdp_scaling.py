"""FSDP2 across N GPUs vs one GPU on the same global batch, through ``TrainBackend`` (issue: two-GPU runs).

Every rank builds the same model (fixed seed) and samples the same global batches with the initial policy
(same seeds, same bits on every GPU of one kind), then trains its contiguous share for ``--steps`` steps.
The one-GPU run (``--save``) writes its losses and final trainable weights; the N-GPU run (``--compare``)
reads them and reports the per-step loss difference, the weights' max |diff| and relative L2 distance, and
throughput per GPU (samples/s; tokens/s for LMs, image-steps/s for diffusion).

  python benchmarks/gpu_fsdp_scaling.py --family lm --save /tmp/w1.pt
  torchrun --standalone --nproc_per_node 2 benchmarks/gpu_fsdp_scaling.py --family lm --compare /tmp/w1.pt
  # CPU smoke run (gloo): --preset tiny --device cpu

Shapes as ``gpu_exactness.py``: ``sd35m`` LoRA r32 bf16 512 px, 10 steps all trained, CFG 4.5, gradient
checkpointing; Qwen3-0.6B full fine-tune, 64-token prompts, 128 new tokens. ``--fp32`` trains the LM in
fp32 (the reduction order of the gradient all-reduce then is the only difference between the runs).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import count_flops, environment, matmul_peak_tflops, mfu, write_record  # noqa: E402
from gpu_exactness import diffusion_setup, lm_setup, with_advantages  # noqa: E402

from unirl_core.train import TrainBackend, TrainConfig  # noqa: E402
from unirl_core.train.distributed import init_distributed  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def work_units(family: str, batch, n_steps_trained: int) -> float:
    """Tokens (LM: completion tokens) or image-steps (diffusion: samples x trained denoising steps)."""
    if family == "lm":
        return float(sum(int(p.segment.response_mask.sum()) for p in batch.generated))
    return float(len(batch.generated) * n_steps_trained)


def model_flops(family: str, rollout, algo, batch) -> float:
    """One forward + backward of the global batch under the algorithm's loss (what ``TrainBackend.step`` computes
    over all ranks), counted on the unsharded rollout copy without checkpointing: LM sample by sample (lengths
    differ), diffusion on one sample times the batch (every sample has the same shape)."""
    from unirl_core.types import SampleBatch

    def fwd_bwd(mb) -> None:
        if hasattr(algo, "loss_terms"):  # as the backend runs it: one term's graph alive at a time
            for term in algo.loss_terms(rollout, mb, old_log_probs=None):
                term.backward()
        else:
            algo.loss(rollout, mb, old_log_probs=None).loss.backward()

    def one(s) -> int:
        return count_flops(fwd_bwd, SampleBatch(samples=[s]))

    total = sum(map(one, batch.samples)) if family == "lm" else one(batch.samples[0]) * len(batch.samples)
    rollout.module.zero_grad(set_to_none=True)
    return float(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("diffusion", "lm"), required=True)
    ap.add_argument("--finetune", choices=("lora", "full"), default=None,
                    help="default: lora for diffusion, full for lm")
    ap.add_argument("--preset", choices=("tiny", "recipe"), default="recipe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fp32", action="store_true", help="lm: fp32 model (tiny preset is fp32 unless --bf16)")
    ap.add_argument("--bf16", action="store_true", help="tiny preset in bf16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-micro-batches", type=int, default=4,
                    help="micro-batches in the global batch (split evenly over the ranks)")
    ap.add_argument("--save", default=None, help="one-GPU run: write losses + weights here")
    ap.add_argument("--compare", default=None, help="N-GPU run: compare with the one-GPU run saved here")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--lm-shape", choices=("qwen3-0.6b", "qwen3-1.7b"), default="qwen3-0.6b")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--grad-ckpt", action="store_true")
    args = ap.parse_args()
    args.finetune = args.finetune or ("lora" if args.family == "diffusion" else "full")
    info = init_distributed(args.device)
    dev = info.device
    if dev.type == "cpu":
        torch.set_num_threads(1)
    if args.global_micro_batches % info.world_size:
        raise SystemExit(f"--global-micro-batches={args.global_micro_batches} must divide by the world size "
                         f"{info.world_size}")
    torch.manual_seed(0)
    if args.family == "lm":
        rollout, sample, algo, mb, wrap, ckpt = lm_setup(args, str(dev))
    else:
        rollout, sample, algo, mb, wrap, ckpt = diffusion_setup(args, str(dev))
    trainer = copy.deepcopy(rollout)
    ckpt(trainer)
    shard = "always" if info.world_size > 1 else "never"
    cfg = TrainConfig(lr=1e-5 if args.finetune == "full" else 1e-4, micro_batch_size=mb, shard=shard,
                      fsdp_wrap_classes=wrap if shard != "never" else (), max_grad_norm=1.0)
    backend = TrainBackend(trainer, algo, cfg, dist_info=info)
    n = args.global_micro_batches * mb
    # Every batch comes from the initial policy (version 0), so both runs train on identical bits.
    batches = []
    for k in range(args.steps):
        torch.manual_seed(1000 + k)
        batches.append(with_advantages(sample(rollout, 0, n)))
    trained_steps = 10 if args.family == "diffusion" else 1
    flops = [model_flops(args.family, rollout, algo, b) for b in batches] if info.is_main else [None] * len(batches)
    peak_tflops = matmul_peak_tflops(str(dev)) if info.is_main else None
    rows = []
    for k, batch in enumerate(batches):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        _sync(dev)
        t0 = time.perf_counter()
        m = backend.step(batch)
        _sync(dev)
        dt = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
        units = work_units(args.family, batch, trained_steps)
        rows.append({"step": k + 1, "loss": m.loss, "grad_norm": m.grad_norm, "train_s": dt, "peak_gib": peak,
                     "samples_per_s_per_gpu": n / dt / info.world_size,
                     "units_per_s_per_gpu": units / dt / info.world_size, "model_flops_per_step": flops[k],
                     # every GPU's share of the step's model FLOPs over the step time and one GPU's peak
                     "mfu": mfu(flops[k], dt * info.world_size, peak_tflops)})
        if info.is_main:
            print(json.dumps(rows[-1]), flush=True)
    state = backend.model_state_dict()
    if info.is_main:
        state = {k: v.detach().float().cpu() for k, v in state.items()}
        out = {"family": args.family, "finetune": args.finetune, "world": info.world_size, "preset": args.preset,
               "dtype": str(backend.compute_dtype), "micro_batch": mb, "global_batch": n, "steps": rows,
               "peak_tflops": peak_tflops, "model_flops_per_step": statistics.median(flops),
               "mfu": statistics.median(r["mfu"] for r in rows[1:] or rows), "env": environment()}
        if args.save:
            torch.save({"state": state, "rows": rows}, args.save)
        if args.compare:
            ref = torch.load(args.compare, weights_only=True)
            max_abs, num, den = 0.0, 0.0, 0.0
            for name, w in ref["state"].items():
                d = (state[name] - w).double()
                max_abs = max(max_abs, d.abs().max().item())
                num += d.pow(2).sum().item()
                den += w.double().pow(2).sum().item()
            loss_diff = [abs(a["loss"] - b["loss"]) for a, b in zip(rows, ref["rows"])]
            # Steady state: the median over steps after the first (warm-up, allocator, NCCL setup).
            tail = lambda rs: sorted(r["train_s"] for r in rs[1:] or rs)[len(rs[1:] or rs) // 2]  # noqa: E731
            out["compare"] = {
                "loss_absdiff_per_step": loss_diff, "weights_max_absdiff": max_abs,
                "weights_rel_l2": (num / den) ** 0.5 if den else 0.0, "tensors": len(ref["state"]),
                "bitwise_equal": max_abs == 0.0, "step_s_1gpu": tail(ref["rows"]), "step_s_ngpu": tail(rows),
                "speedup": tail(ref["rows"]) / tail(rows),
                "per_gpu_efficiency": tail(ref["rows"]) / tail(rows) / info.world_size,
                "peak_gib_1gpu": max(r["peak_gib"] for r in ref["rows"]),
                "peak_gib_per_rank": max(r["peak_gib"] for r in rows),
                "mfu_1gpu": statistics.median(r.get("mfu", float("nan")) for r in ref["rows"][1:] or ref["rows"]),
                "mfu_ngpu": out["mfu"]}
            print("COMPARE " + json.dumps(out["compare"]), flush=True)
        cell = f"{args.family}_{args.finetune}_{'fp32' if args.fp32 else 'bf16'}_w{info.world_size}_{dev.type}"
        table = out.get("compare") or {"step_s": statistics.median(r["train_s"] for r in rows[1:] or rows),
                                        "mfu": out["mfu"]}
        md = "| metric | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in table.items())
        md += ("\nMFU: the global batch's forward + backward model FLOPs (FlopCounterMode on the unsharded model, "
               "no recomputation) over (steady step time x GPUs x one GPU's measured bf16 matmul peak); nan on a CPU.\n")
        write_record("fsdp_scaling", out, md, cell=cell, env=out["env"])
        print("RESULT " + json.dumps({k: v for k, v in out.items() if k != "env"}), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
