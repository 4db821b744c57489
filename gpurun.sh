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
D=(data.shapes.num_prompts=9 data.shapes.distinct=true data.prompts_per_step=9 grouping.enhancements_per_prompt=16)
run d9_t0.7_s1 1 "${D[@]}" enhancer.lm.sampling.temperature=0.7
run d9_t0.7_s2 2 "${D[@]}" enhancer.lm.sampling.temperature=0.7
run d9_t0.7_s3 3 "${D[@]}" enhancer.lm.sampling.temperature=0.7
run d9_t0.7_s4 4 "${D[@]}" enhancer.lm.sampling.temperature=0.7
run d9_t0.7_s5 5 "${D[@]}" enhancer.lm.sampling.temperature=0.7
run d9_t0.7_kl0.05_s0 0 "${D[@]}" "${K[@]}" enhancer.lm.algorithm.beta=0.05 enhancer.lm.sampling.temperature=0.7
run d9_t0.7_kl0.05_s1 1 "${D[@]}" "${K[@]}" enhancer.lm.algorithm.beta=0.05 enhancer.lm.sampling.temperature=0.7
run d9_t0.7_kl0.05_s2 2 "${D[@]}" "${K[@]}" enhancer.lm.algorithm.beta=0.05 enhancer.lm.sampling.temperature=0.7
run d9_t0.7_kl0.05_s3 3 "${D[@]}" "${K[@]}" enhancer.lm.algorithm.beta=0.05 enhancer.lm.sampling.temperature=0.7
run d9_t1_s0 0 "${D[@]}"
run d9_t1_s1 1 "${D[@]}"
run d9_t1_s2 2 "${D[@]}"
sleep 20; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv; uptime
wait
for f in $OUT/*.log; do echo "== $f"; grep -E "^seed|^step [0-9]+/" $f | tail -n 2 | cut -c1-250; done
