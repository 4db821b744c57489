"""Train-step time and peak memory of each diffusion algorithm vs Flow-GRPO at the same shape, in one run.

Every algorithm trains the same rollout micro-batch (10-step, CFG 4.5 SDE trajectories of the SD3.5-Medium-shaped
transformer, random init, LoRA r32 / alpha 64, 512 px; ``--preset tiny``: the tiny SD3 preset at 64 px, CPU) through
the shipped path: ``TrainBackend.step`` (pi_old freeze, per-term backward, clip + AdamW) with its registered
algorithm, on its own copy of the same weights, one update per batch, all 10 steps / noise levels trained, no KL:

- ``flow_grpo``: pi_old = the rollout's log-probs (no pre-pass), CFG forwards of 2B rows per trained step.
- ``grpo_guard``: the same forwards, RatioNorm + step reweighting on top.
- ``flow_dppo``: a no-grad replay of pi_old over the micro-batch first (it keeps the step means), then as
  Flow-GRPO with the KL trust region.
- ``mixgrpo_window4``: Flow-GRPO on a MixGRPO-windowed rollout (4 SDE steps of 10, ODE elsewhere): 4 trained steps.
- ``flow_grpo_no_cfg``: Flow-GRPO on a rollout without CFG (guidance 1): B rows per trained step.
- ``nft``: a no-grad pass computing v_old under the EMA weights (``train.ema_decay``), then per noise level one
  conditional forward of B rows (NFT trains without CFG) on re-noised clean samples.
- ``elbo_pg``: ELBO policy gradient at the ``sd35m-elbo-pg`` recipe's settings (PEPG, adaptive weighting, 9 of the
  10 levels, one eps each, KL 1e-4 to the LoRA-off reference) on an ODE rollout without CFG: a no-grad pass of
  ELBO_old, then per pair one conditional forward of B rows and a reference forward, on the re-noised final sample.

Flow-GRPO is the baseline measured in the same run; times are medians of interleaved rounds after a warmup step
each, with the median of per-round ratios (algo / flow_grpo). Peak = max allocated during one step minus what was
allocated before it (CUDA only).

  python benchmarks/bench_diffusion_algos.py --device cuda                    # SD3.5-M shape, micro-batch 4
  OMP_NUM_THREADS=1 python benchmarks/bench_diffusion_algos.py --preset tiny --device cpu
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import copy
from dataclasses import replace
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_diffusion_replay import micro_batch
from bench_diffusion_rollout import build, sync
from bench_flow_grpo_step import peak_of
from common import count_flops, fmt_mfu, matmul_peak_tflops, mfu_fields, report, without_recompute

from unirl_core.algorithms.elbo_pg import ELBOPGConfig
from unirl_core.algorithms.flow_dppo import FlowDPPOConfig
from unirl_core.algorithms.flow_grpo import FlowGRPOConfig
from unirl_core.algorithms.grpo_guard import GRPOGuardConfig
from unirl_core.algorithms.nft import DiffusionNFTConfig
from unirl_core.algorithms.registry import build_algorithm
from unirl_core.sde import flow_sigmas
from unirl_core.train import TrainBackend, TrainConfig
from unirl_core.types import DiffusionSamplingParams

LR, G = 3e-4, 4.5


WINDOW = [0, 1, 2, 3]  # MixGRPO: a 4-step SDE window at its first position (ODE elsewhere, only the window trained)
BATCHES = {"mixgrpo_window4": "window", "flow_grpo_no_cfg": "no_cfg", "elbo_pg": "ode"}  # rows that train another rollout batch


def algorithms(b: int) -> dict[str, tuple[object, TrainConfig]]:
    """name -> (algorithm config, train config) at micro-batch ``b``."""
    base = {"lr": LR, "weight_decay": 1e-4, "micro_batch_size": b, "max_grad_norm": 1.0}
    return {
        "flow_grpo": (FlowGRPOConfig(replay_batch_size=b, clip_range=1e-4), TrainConfig(**base)),
        # Flow-GRPO on a MixGRPO-windowed rollout (4 SDE steps of 10) and on a rollout without CFG (guidance 1):
        # the same loss, fewer trained steps / half the rows per forward.
        "mixgrpo_window4": (FlowGRPOConfig(replay_batch_size=b, clip_range=1e-4), TrainConfig(**base)),
        "flow_grpo_no_cfg": (FlowGRPOConfig(replay_batch_size=b, clip_range=1e-4), TrainConfig(**base)),
        "grpo_guard": (GRPOGuardConfig(replay_batch_size=b, clip_range=1e-4), TrainConfig(**base)),
        "flow_dppo": (FlowDPPOConfig(replay_batch_size=b, kl_bound=1e-4),
                      TrainConfig(**base, old_logp_source="replay")),
        "nft": (DiffusionNFTConfig(replay_batch_size=b, old_policy="ema"),
                TrainConfig(**base, old_logp_source="replay", ema_decay=0.9)),
        # the sd35m-elbo-pg recipe's algorithm block
        "elbo_pg": (ELBOPGConfig(objective="pepg", weighting="adaptive", timestep_fraction=0.99, noise_draws=1,
                                 advantage_scale=0.1, kl_beta=1e-4, replay_batch_size=b),
                    TrainConfig(**base, old_logp_source="replay")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("tiny", "sd35m"), default="sd35m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated algorithms besides flow_grpo (default: all)")
    ap.add_argument("--layers", type=int, default=None, help="sd35m only: fewer layers (CPU smoke test)")
    ap.add_argument("--height", type=int, default=None)
    args = ap.parse_args()
    tiny = args.preset == "tiny"
    if args.device == "cpu":
        torch.set_num_threads(1)
    height = args.height or (64 if tiny else 512)
    b = args.micro_batch
    rollout = build(args.preset, args.device, "float32" if tiny else "bfloat16", args.layers, finetune="lora",
                    lora_rank=32)
    sampling = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=10), guidance_scale=G, height=height,
                                       width=height, noise_level=0.7)
    batches = {"all": micro_batch(rollout, args.preset, b, sampling),
               "window": micro_batch(rollout, args.preset, b, sampling, sde_steps=WINDOW),
               "no_cfg": micro_batch(rollout, args.preset, b, replace(sampling, guidance_scale=1.0)),
               # ELBO-PG's rollout: the ODE (no SDE step), no CFG
               "ode": micro_batch(rollout, args.preset, b, replace(sampling, guidance_scale=1.0), sde_steps=[])}
    chosen = algorithms(b)
    if args.only:
        keep = {"flow_grpo", *args.only.split(",")}
        chosen = {k: v for k, v in chosen.items() if k in keep}
    peak_tflops = matmul_peak_tflops(args.device)
    backends, firsts, peaks, failed, flops = {}, {}, {}, {}, {}
    for name, (algo_cfg, train_cfg) in chosen.items():
        bundle = copy.deepcopy(rollout)
        bundle.module.train()
        backend = TrainBackend(bundle, build_algorithm(algo_cfg), train_cfg)
        mb = batches[BATCHES.get(name, "all")]
        try:
            # warmup, first update of the batch, and the algorithm's model FLOPs: every forward it runs (CFG rows,
            # a pi_old / EMA pass) and the backward (LoRA: no weight gradients of the frozen base)
            with without_recompute(bundle.module):
                flops[name] = count_flops(lambda be=backend, m=mb: firsts.__setitem__(name, be.step(m).metrics))
            peaks[name] = peak_of(lambda be=backend, m=mb: be.step(m), args.device)
        except Exception as e:  # one algorithm's failure is a row of the table, not the end of the run
            if name == "flow_grpo":
                raise
            failed[name] = f"{type(e).__name__}: {e}"[:200]
            print(f"{name} failed: {failed[name]}", flush=True)
            del backend, bundle
            continue
        backends[name] = backend
    clock = time.thread_time if args.device == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {n: [] for n in backends}
    names = list(backends)
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            sync(args.device)
            t0 = clock()
            backends[name].step(batches[BATCHES.get(name, "all")])
            sync(args.device)
            times[name].append(clock() - t0)
    base = times["flow_grpo"]
    rows, data = [], []
    for name in names:
        med = statistics.median(times[name])
        pair = statistics.median(x / y for x, y in zip(times[name], base))
        m = mfu_fields(flops[name], med, peak_tflops)
        algo_cfg = chosen[name][0]  # ELBO-PG trains estimator pairs (levels x draws), not steps
        trained = firsts[name].get("trained_steps", algo_cfg.pairs_per_sample(10)
                                   if isinstance(algo_cfg, ELBOPGConfig) else float("nan"))
        rows.append([name, f"{med:.3f}", f"{pair:.3f}", f"{peaks[name]:.2f}", f"{trained:.0f}", f"{flops[name] / 1e12:.3g}",
                     fmt_mfu(m["mfu"])])
        data.append({"algorithm": name, "step_s": med, "median_pair_ratio_vs_flow_grpo": pair,
                     "peak_gib": peaks[name], "times": times[name], "first_update_metrics": firsts[name], **m})
    for name, err in failed.items():
        rows.append([name, "failed", err, "", "", "", ""])
        data.append({"algorithm": name, "error": err})
    cell = f"{args.preset}_{args.device.split(':')[0]}"
    if args.layers or args.height:
        cell += "_smoke"
    if args.only:  # a subset never replaces the cell of the whole table
        cell += "_" + "-".join(sorted(set(args.only.split(","))))
    report("diffusion_algos", f"Diffusion algorithms: one train step (micro-batch {b}; trained steps per row) vs Flow-GRPO "
                 f"({args.preset}, {height} px)",
           ["algorithm", "step s (median)", "vs flow_grpo (median of pairs)", "peak GiB", "trained steps",
            "model TFLOP", "MFU"],
           rows, {"micro_batch": b, "height": height, "repeats": args.repeats, "results": data},
           notes=f"TrainBackend.step per algorithm on its own copy of the same LoRA r32 weights, the same micro-batch "
                 f"(CFG {G} SDE trajectories; elbo_pg: an ODE rollout without CFG, its trained column counts level x eps "
                 "pairs), one update, no KL (elbo_pg: its recipe's 1e-4 to the LoRA-off reference); "
                 f"median of {args.repeats} interleaved rounds after a "
                 "warmup step each. flow_dppo and nft include their no-grad pi_old pass (step means / v_old under "
                 "EMA); nft trains the conditional velocity only (B rows per forward instead of CFG's 2B). "
                 f"mixgrpo_window4: Flow-GRPO on a rollout whose SDE window is steps {WINDOW} (ODE elsewhere), "
                 "only the window trained; flow_grpo_no_cfg: Flow-GRPO on a guidance-1 rollout (B rows per forward). "
                 "Peak: CUDA only (nan on CPU). MFU: the algorithm's model FLOPs per step (FlopCounterMode over its "
                 "first step: every forward it runs and the backward, LoRA's frozen base without weight gradients) "
                 "over the median step and this GPU's measured bf16 matmul peak (`-` on a CPU).", cell=cell)


if __name__ == "__main__":
    main()
