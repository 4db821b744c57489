#!/usr/bin/env bash
# untracked: compose climb sweep on the GPU box (delete after)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
STEPS=${STEPS:-60}; LIMIT=${LIMIT:-545}
K=(enhancer.lm.model.keep_reference=true)
run() { name=$1; seed=$2; shift 2
  timeout $LIMIT python3 benchmarks/compose_enhance_climb.py --recipe shapes-enhance-colour --seeds $seed --name $name \
    --results $OUT --overrides enhancer.lm.model.device=cuda image.diffusion.model.device=cuda loop.total_steps=$STEPS "$@" \
    > $OUT/$name.log 2>&1 & }
run base_s0 0
run t0.7_kl0_lr1e-3_s1 1 enhancer.lm.sampling.temperature=0.7
run t0.7_kl0_lr1e-3_s2 2 enhancer.lm.sampling.temperature=0.7
run t0.7_kl0.05_lr1e-3_s1 1 "${K[@]}" enhancer.lm.algorithm.beta=0.05 enhancer.lm.sampling.temperature=0.7
run t0.7_kl0.05_lr1e-3_s2 2 "${K[@]}" enhancer.lm.algorithm.beta=0.05 enhancer.lm.sampling.temperature=0.7
run t0.7_kl0.1_lr1e-3_s0 0 "${K[@]}" enhancer.lm.algorithm.beta=0.1 enhancer.lm.sampling.temperature=0.7
run t0.7_kl0.1_lr1e-3_s1 1 "${K[@]}" enhancer.lm.algorithm.beta=0.1 enhancer.lm.sampling.temperature=0.7
run t0.5_kl0_lr1e-3_s0 0 enhancer.lm.sampling.temperature=0.5
run t0.5_kl0_lr1e-3_s1 1 enhancer.lm.sampling.temperature=0.5
run kl0.1_lr1.5e-3_s1 1 "${K[@]}" enhancer.lm.algorithm.beta=0.1 enhancer.train.lr=1.5e-3
run t0.7_kl0.02_lr1e-3_s0 0 "${K[@]}" enhancer.lm.algorithm.beta=0.02 enhancer.lm.sampling.temperature=0.7
run t0.7_kl0_lr7e-4_s0 0 enhancer.lm.sampling.temperature=0.7 enhancer.train.lr=7e-4
sleep 20; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv; uptime
wait
for f in $OUT/*.log; do echo "== $f"; grep -E "^seed|^step [0-9]+/" $f | tail -n 2 | cut -c1-250; done
