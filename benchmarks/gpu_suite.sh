#!/usr/bin/env bash
# The GPU benchmarks the README's GPU tables come from, as parts that each fit in a 10-minute call, results
# copied to $RESULTS after every benchmark (a call cut by its time limit keeps what finished).
#
#   RESULTS=out bash benchmarks/gpu_suite.sh algos      # bench_diffusion_algos on GPU 0 (#17's table, ~3 min)
#   RESULTS=out bash benchmarks/gpu_suite.sh singles    # GPU 0: diffusion algorithms then the Flow-GRPO step;
#                                                       # GPU 1: GRPO vs TRL at 0.6B (master weights = model) and math
#   RESULTS=out bash benchmarks/gpu_suite.sh pool [gpu_pool_loop.py args]   # the pool loop (two GPUs)
#     ... pool --preset sd35m-lora --modes warm flyte-pool-shared   # the Flyte workflow in pool mode (one GPU;
#     flytekit and Ray carried as the tarball of benchmarks/gpu_carry_bundle.sh, unpacked onto PYTHONPATH)
#   RESULTS=out bash benchmarks/gpu_suite.sh step-cost  # bench_step_cost at the GPU shapes
#   RESULTS=out bash benchmarks/gpu_suite.sh graphs     # lm.engine.cuda_graphs: decode throughput, GRPO vs TRL
#   RESULTS=out bash benchmarks/gpu_suite.sh graphs-math  # the same at the qwen3-math shape, loop + TRL in one call (~6.5 min)
#   RESULTS=out bash benchmarks/gpu_suite.sh rollout-cfg  # SD3.5-M rollout with cfg_batch joint vs split (~3 min)
#   RESULTS=out bash benchmarks/gpu_suite.sh flowstep   # Flow-GRPO step vs the reference loop, cfg_batch joint + split
#   RESULTS=out bash benchmarks/gpu_suite.sh delta      # full vs delta weights-only versions, Qwen3-0.6B full FT shape
#   RESULTS=out bash benchmarks/gpu_suite.sh two-gpu    # #57 on 2 GPUs: full vs delta publish over NCCL
#                                                       # (bench_delta_wire, then gpu_pool_loop pool-separate)
#
# Needs torch with CUDA, diffusers, transformers, peft (and trl for the TRL side, ray for the pool) importable.
# LIMIT (seconds, default 540) bounds each part. Two-GPU hosts: NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -uo pipefail

PART="${1:-}"; shift || true
RESULTS="${RESULTS:-$(mktemp -d)}"  # logs + copies of the records written; the records themselves: benchmarks/results
LIMIT="${LIMIT:-540}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
mkdir -p "$RESULTS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS

left() { echo $((LIMIT - (SECONDS - START))); }

# bench <log name> <record glob> <command...>: run within the time left, log, copy the records it wrote at once
# (benchmarks/results/<benchmark>/latest.*, only those newer than its start: earlier records stay behind)
bench() {
  local name="$1" glob="$2"; shift 2
  local t; t="$(left)"
  if [ "$t" -le 10 ]; then echo "$name: no time left" | tee -a "$RESULTS/$name.txt"; return; fi
  local stamp; stamp="$(mktemp)"
  timeout "$t" "$@" >>"$RESULTS/$name.txt" 2>&1
  echo "$name rc $?" >>"$RESULTS/$name.txt"
  if [ "$RESULTS" != "benchmarks/results" ]; then
    find benchmarks/results -mindepth 1 -maxdepth 1 -type d -name "$glob" | while read -r d; do
      if [ "$d/latest.json" -nt "$stamp" ]; then mkdir -p "$RESULTS/${d##*/}" && cp "$d"/latest.* "$RESULTS/${d##*/}/"; fi
    done
  fi
  rm -f "$stamp"
}

case "$PART" in
  algos)
    CUDA_VISIBLE_DEVICES=0 bench algos "diffusion_algos" python3 benchmarks/bench_diffusion_algos.py --device cuda ;;
  singles)
    ( export CUDA_VISIBLE_DEVICES=0
      bench algos "diffusion_algos" python3 benchmarks/bench_diffusion_algos.py --device cuda
      bench flowstep "flow_grpo_step" python3 benchmarks/bench_flow_grpo_step.py ) &
    ( export CUDA_VISIBLE_DEVICES=1
      root="$(mktemp -d)"
      bench grpo06 "grpo_recipe_*" python3 benchmarks/bench_grpo_recipe.py --preset 0.6b --device cuda \
        --master-weights model --full-state-every 10 --checkpoint-root "$root"
      bench grpomath "grpo_recipe_*" python3 benchmarks/bench_grpo_recipe.py --preset math --device cuda \
        --master-weights model --checkpoint-root "$root" --rounds 1 --steps 3 --warmup 1
      rm -rf "$root" ) &
    wait ;;
  pool)
    root="$(mktemp -d)"
    bench pool "pool_loop" python3 benchmarks/gpu_pool_loop.py --keep --root "$root" "$@"
    # the per-mode JSONs (per-step metrics); each mode's checkpoint versions are deleted after it ran
    (cd "$root" && find . -name '*.json' | tar czf "$RESULTS/pool_modes.tgz" -T -) 2>/dev/null; rm -rf "$root" ;;
  graphs)
    # lm.engine.cuda_graphs: decode throughput (row engine_rescore_graphs), then the GRPO step vs TRL with it
    CUDA_VISIBLE_DEVICES=0 bench arrollout "ar_rollout" python3 benchmarks/bench_ar_rollout.py \
      --preset qwen3-0.6b --device cuda --dtype bfloat16 --batch 64 --new-tokens 256
    root="$(mktemp -d)"
    CUDA_VISIBLE_DEVICES=0 bench grpo06g "grpo_recipe_*" python3 benchmarks/bench_grpo_recipe.py --preset 0.6b \
      --device cuda --master-weights model --full-state-every 10 --logprob-chunk 256 --rollout-with-trainer \
      --cuda-graphs --sides loop,trl --steps 4 --warmup 1 --rounds 2 --timeout 150 --checkpoint-root "$root"
    rm -rf "$root" ;;
  graphs-math)
    # peak vs TRL's at the qwen3-math shape with graphs (the decoder's close() frees its cuBLAS workspaces)
    root="$(mktemp -d -p /dev/shm 2>/dev/null || mktemp -d)"
    CUDA_VISIBLE_DEVICES=0 bench grpomathg "grpo_recipe_*" python3 benchmarks/bench_grpo_recipe.py --preset math \
      --device cuda --master-weights model --full-state-every 10 --logprob-chunk 256 --rollout-with-trainer \
      --cuda-graphs --sides loop,trl --rounds 1 --steps 2 --warmup 1 --timeout 270 --checkpoint-root "$root" --name same-call
    rm -rf "$root" ;;
  rollout-cfg)
    # the rollout's cost of cfg_batch split vs joint (each against the plain diffusers loop, batch 8)
    for mode in joint split; do
      CUDA_VISIBLE_DEVICES=0 bench rollcfg "diffusion_rollout" python3 benchmarks/bench_diffusion_rollout.py \
        --preset sd35m --device cuda --sizes 8 --cfg-batch "$mode"
    done ;;
  delta)
    # bytes per version, write and publish time of full vs delta versions (checkpoint.weights_encoding), on the disk:
    # Qwen3-0.6B full fine-tune (qwen3-math's lr), SD3.5-M LoRA r32 (the sd35m recipes' lr), SD3.5-M full (lr 1e-5)
    root="$(mktemp -d)"
    for spec in "qwen3-0.6b --steps 6" "sd35m-lora --steps 6 --batch 1" "sd35m-full --steps 5 --batch 1 --lr 1e-5"; do
      # shellcheck disable=SC2086  # spec: the shape and its arguments
      CUDA_VISIBLE_DEVICES=0 bench "delta-${spec%% *}" "delta_versions" python3 benchmarks/bench_delta_versions.py \
        --device cuda --root "$root" --shape $spec "$@"
    done
    rm -rf "$root" ;;
  two-gpu)
    # #57: trainer on GPU 0, engine on GPU 1, a version published every step over NCCL, full vs delta on the wire.
    # bench_delta_wire (bytes, publish time, delta-fed == full-fed engine bitwise) at Qwen3-0.6B full FT and the
    # SD3.5-M LoRA adapter; then the pool loop's separate placement, full vs delta versions (cells two-gpu-full /
    # two-gpu-delta of pool_loop: per-step pool/publish_bytes, pool/publish_delta, pool/publish_send_s, rewards).
    for spec in "qwen3-0.6b --steps 6" "sd35m-lora --steps 6 --batch 1"; do
      # shellcheck disable=SC2086  # spec: the shape and its arguments
      CUDA_VISIBLE_DEVICES=0,1 bench "wire-${spec%% *}" "delta_wire" python3 benchmarks/bench_delta_wire.py \
        --device cuda --shape $spec "$@"
    done
    root="$(mktemp -d)"
    for enc in full delta; do  # the same full-state cadence on both sides (a delta version needs every_n_steps > 1)
      CUDA_VISIBLE_DEVICES=0,1 bench "pool-$enc" "pool_loop" python3 benchmarks/gpu_pool_loop.py --keep \
        --root "$root" --preset qwen3-0.6b sd35m-lora --modes pool-separate --cell "two-gpu-$enc" \
        --override checkpoint.every_n_steps=5 --override "checkpoint.weights_encoding=$enc"
    done
    (cd "$root" && find . -name '*.json' | tar czf "$RESULTS/pool_two_gpu.tgz" -T -) 2>/dev/null; rm -rf "$root" ;;
  flowstep)
    CUDA_VISIBLE_DEVICES=0 bench flowstep "flow_grpo_step" python3 benchmarks/bench_flow_grpo_step.py "$@" ;;
  step-cost)
    # the state dir in RAM: writing the full-scope versions to the machine's disk took most of a call before
    root="$(mktemp -d -p /dev/shm 2>/dev/null || mktemp -d)"
    bench stepcost "step_cost" python3 benchmarks/bench_step_cost.py --root "$root" \
      --preset sd35m-lora sd35m-full qwen3-0.6b "$@"
    rm -rf "$root" ;;
  *)
    echo "usage: RESULTS=<dir> bash benchmarks/gpu_suite.sh algos|singles|pool|step-cost|graphs|graphs-math|flowstep|rollout-cfg|delta|two-gpu [args]" >&2; exit 2 ;;
esac
ls -la "$RESULTS"
