"""Exactness through the trainer at recipe shapes: engine rollout -> TrainBackend.step, two steps.

The loop's own split: a rollout bundle (the engine samples with it, parameters in the model dtype) and
a trainer bundle the backend owns (fp32 masters of the trainable weights; plain module or FSDP2). After
step 1 the trainer's weights reach the rollout bundle as the loop moves them (a full-precision state dict
copied into the rollout module, rounding to its dtype) and the second batch is sampled with them. The
contract: each step's first update has ratio exactly 1 and |logp_rollout - logp_replay| exactly 0.

  python benchmarks/gpu_exactness.py --family diffusion --finetune lora --shard never --device cuda
  torchrun --standalone --nproc_per_node 2 benchmarks/gpu_exactness.py --family lm --finetune full --shard auto
  OMP_NUM_THREADS=1 python benchmarks/gpu_exactness.py --family lm --preset tiny   # CPU smoke run

Shapes: ``sd35m`` is SD3.5-Medium's transformer (random init, bf16), 512 px, 10 steps all trained, CFG 4.5,
micro-batch 4, gradient checkpointing (what the sd35m recipes set); ``qwen3-0.6b`` is Qwen3-0.6B
(random init, bf16), 16 prompts of 64 tokens, 128 new tokens, micro-batch 8. Each rank rolls out the whole
batch (same seeds, same bits) and trains its contiguous share.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment, write_record  # noqa: E402

from unirl_core.train import TrainBackend, TrainConfig  # noqa: E402
from unirl_core.train.distributed import init_distributed  # noqa: E402
from unirl_core.types import Sample, SampleBatch  # noqa: E402


def diffusion_setup(args, device: str):
    from bench_diffusion_replay import micro_batch
    from bench_diffusion_rollout import build

    from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
    from unirl_core.sde import flow_sigmas
    from unirl_core.types import DiffusionSamplingParams

    preset = "tiny" if args.preset == "tiny" else "sd35m"
    dtype = "float32" if preset == "tiny" and not args.bf16 else "bfloat16"
    rollout = build(preset, device, dtype, args.layers, finetune=args.finetune)
    height = args.height or (64 if preset == "tiny" else 512)
    sampling = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=10), guidance_scale=4.5, height=height,
                                       width=height, noise_level=0.7)
    mb = args.micro_batch or (8 if preset == "tiny" else 4)

    def sample(bundle, version: int, n: int) -> SampleBatch:
        out = []
        for lo in range(0, n, mb):  # the engine's forward slices = the trainer's micro-batches
            part = micro_batch(bundle, preset, mb, sampling)
            for i, s in enumerate(part.samples):
                sid = f"s{lo + i}"
                gid = f"g{(lo + i) // 4}"
                p = s.generated.copy(policy_version=version, sample_id=sid, group_id=gid)
                out.append(Sample(sample_id=sid, group_id=gid, parts=[p]))
        return SampleBatch(samples=out)

    algo = FlowGRPO(FlowGRPOConfig(replay_batch_size=mb, clip_range=1e-4, logp_tolerance=None))
    wrap = ("JointTransformerBlock",)
    return rollout, sample, algo, mb, wrap, lambda b: b.module.enable_gradient_checkpointing() if preset != "tiny" else None


def lm_setup(args, device: str):
    from bench_ar_rollout import build_bundle, prompts

    from unirl_core.algorithms.grpo import GRPO, GRPOConfig
    from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
    from unirl_core.types import ARSamplingParams, PromptRecord

    preset = "tiny" if args.preset == "tiny" else args.lm_shape
    fp32 = (preset == "tiny" and not args.bf16) or getattr(args, "fp32", False)
    dtype = torch.float32 if fp32 else torch.bfloat16
    extra = {"gradient_checkpointing": True} if args.grad_ckpt else {}
    rollout = build_bundle(preset, dtype, device, finetune=args.finetune, **extra)
    mb = args.micro_batch or 8
    texts = prompts(rollout, 64, args.prompt_len or (64 if preset != "tiny" else 8))
    sp = ARSamplingParams(temperature=1.0, max_new_tokens=args.new_tokens or (128 if preset != "tiny" else 16),
                          seed=0)

    def sample(bundle, version: int, n: int) -> SampleBatch:
        recs = [PromptRecord(prompt_id=f"p{i}", prompt=t) for i, t in enumerate(texts[:n // 4])]
        req = SampleBatch.from_prompts(recs, samples_per_prompt=4, kind="ar", sampling=sp, policy_version=version)
        eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=mb, apply_chat_template=False,
                                                       ignore_eos=True), policy_version=version)
        return eng.generate(req)

    algo = GRPO(GRPOConfig(max_logp_absdiff=None))
    wrap = ("Qwen3DecoderLayer",)
    return rollout, sample, algo, mb, wrap, lambda b: None


def with_advantages(batch: SampleBatch) -> SampleBatch:
    for i, p in enumerate(batch.generated):
        if p.advantage is None:
            p.advantage = 1.0 if i % 2 else -1.0
    return batch


def publish_to_rollout(backend: TrainBackend, rollout) -> None:
    """What the loop does between steps: the trainer's full-precision weights, copied into the rollout model."""
    state = backend.model_state_dict()  # collective under FSDP; complete on every rank here (full_state_dict)
    if backend.world_size > 1:
        obj = [state if backend.rank == 0 else None]
        torch.distributed.broadcast_object_list(obj, src=0)
        state = obj[0]
    dev = next(rollout.module.parameters()).device
    rollout.module.load_state_dict({k: v.to(dev) for k, v in state.items()}, strict=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("diffusion", "lm"), required=True)
    ap.add_argument("--finetune", choices=("lora", "full"), default="lora")
    ap.add_argument("--shard", choices=("never", "always", "auto"), default="never")
    ap.add_argument("--preset", choices=("tiny", "recipe"), default="recipe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bf16", action="store_true", help="tiny preset in bf16 (recipe shapes are always bf16)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--lm-shape", choices=("qwen3-0.6b", "qwen3-1.7b"), default="qwen3-0.6b")
    ap.add_argument("--prompt-len", type=int, default=None, help="lm: prompt tokens (default 64)")
    ap.add_argument("--new-tokens", type=int, default=None, help="lm: completion tokens (default 128)")
    ap.add_argument("--grad-ckpt", action="store_true", help="lm: activation checkpointing of the decoder layers")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank per step")
    args = ap.parse_args()
    info = init_distributed(args.device)
    device = str(info.device)
    if info.device.type == "cpu":
        torch.set_num_threads(1)
    setup = diffusion_setup if args.family == "diffusion" else lm_setup
    rollout, sample, algo, mb, wrap, ckpt = setup(args, device)
    trainer = copy.deepcopy(rollout)  # the trainer's own bundle (the loop builds a second one)
    ckpt(trainer)
    cfg = TrainConfig(lr=1e-5 if args.finetune == "full" else 1e-4, micro_batch_size=mb, shard=args.shard,
                      fsdp_wrap_classes=wrap if args.shard != "never" else (), max_grad_norm=1.0)
    backend = TrainBackend(trainer, algo, cfg, dist_info=info)
    n = args.micro_batches * mb * info.world_size
    rows = []
    for step in range(2):
        t0 = time.perf_counter()
        batch = with_advantages(sample(rollout, backend.step_count, n))
        t_roll = time.perf_counter() - t0
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        m = backend.step(batch)
        t_train = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**30 if info.device.type == "cuda" else 0.0
        row = {"step": step + 1, "ratio_min": m.metrics["ratio_min"], "ratio_max": m.metrics["ratio_max"],
               "logp_absdiff_max": m.metrics["logp_absdiff_max"], "clip_frac": m.metrics["clip_frac"],
               "loss": m.loss, "grad_norm": m.grad_norm, "rollout_s": t_roll, "train_s": t_train,
               "peak_train_gib": peak}
        rows.append(row)
        if info.is_main:
            print(json.dumps(row), flush=True)
        publish_to_rollout(backend, rollout)
    if info.is_main:
        exact = all(r["ratio_min"] == r["ratio_max"] == 1.0 and r["logp_absdiff_max"] == 0.0 for r in rows)
        out = {"family": args.family, "finetune": args.finetune, "shard": args.shard, "world": info.world_size,
               "lm_shape": args.lm_shape if args.family == "lm" else None, "new_tokens": args.new_tokens,
               "prompt_len": args.prompt_len, "grad_ckpt": args.grad_ckpt,
               "sharded": backend.sharded, "preset": args.preset, "micro_batch": mb, "samples": n,
               "compute_dtype": str(backend.compute_dtype), "exact": exact, "steps": rows, "env": environment()}
        print("RESULT " + json.dumps(out), flush=True)
        cell = f"{args.family}_{args.finetune}_{args.shard}_w{info.world_size}_{info.device.type}"
        if args.family == "lm" and (args.lm_shape != "qwen3-0.6b" or args.new_tokens or args.grad_ckpt):
            cell += f"_{args.lm_shape}_t{args.new_tokens or 128}_mb{mb}" + ("_ckpt" if args.grad_ckpt else "")
        md = "| step | ratio min | ratio max | max abs dlogp |\n|---|---|---|---|\n" + "".join(
            f"| {i} | {r['ratio_min']} | {r['ratio_max']} | {r['logp_absdiff_max']} |\n" for i, r in enumerate(rows))
        write_record("exactness", out, md + f"\nexact: {exact}", cell=cell, env=out["env"])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
