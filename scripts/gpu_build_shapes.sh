#!/usr/bin/env bash
# Train shapes-sd3 candidates on one CUDA GPU side by side (recipe sft-shapes, python -m unirl_core.sft: no
# flytekit needed), pack each export and grade it on held-out prompts. A candidate still training when the time
# is up is exported from its last published chunk (a shorter, unannealed run: its log says so).
#   OUT=out LIMIT=540 bash scripts/gpu_build_shapes.sh "name1:override,override,..." "name2:..."
# Everything ends up in $OUT/shapes-build.tgz (weights, logs, grids, grades).
# Every candidate gets: diffusion.model.device=cuda, checkpoint.root=$WORK/<name>, loop.steps_per_chunk=500.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-shapes-build}
LIMIT=${LIMIT:-540}
WORK=${WORK:-/dev/shm/shapes-build}
PY=${PY:-python3}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
START=$SECONDS
pids=()
names=()
for spec in "$@"; do
  name=${spec%%:*}; ovr=${spec#*:}
  args=(--override "diffusion.model.device=${DEVICE:-cuda}" --override "checkpoint.root=$WORK/$name" --override "loop.steps_per_chunk=${CHUNK:-500}")
  IFS=',' read -ra kv <<< "$ovr"
  for o in "${kv[@]}"; do [ -n "$o" ] && args+=(--override "$o"); done
  echo "$name: ${args[*]}" > "$OUT/$name.log"
  printf '%s\n' "${args[@]}" > "$WORK/$name.args"  # the same arguments, for the export of a cut run
  $PY -m unirl_core.sft --recipe sft-shapes "${args[@]}" >> "$OUT/$name.log" 2>&1 &
  pids+=($!); names+=("$name")
done
# leave ~150 s for the exports and the grading
deadline=$((LIMIT - 150))
while :; do
  alive=0
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive -eq 0 ] && break
  [ $((SECONDS - START)) -ge $deadline ] && { echo "time up: stopping the candidates still training"; \
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; sleep 3; break; }
  sleep 5
done
for i in "${!names[@]}"; do
  name=${names[$i]}
  run="$WORK/$name/sft-shapes"
  if [ ! -f "$run/export/export.json" ]; then
    step=$($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["step"])' "$run/LATEST" 2>/dev/null)
    echo "$name: cut at published step ${step:-none}; exporting that version" | tee -a "$OUT/$name.log"
    [ -z "$step" ] && continue
    # a resume with loop.total_steps = the published step trains nothing and exports that version
    mapfile -t args < "$WORK/$name.args"
    $PY -m unirl_core.sft --recipe sft-shapes "${args[@]}" --override "loop.total_steps=$step" >> "$OUT/$name.log" 2>&1
  fi
  $PY -m examples.shapes.model "$run/export" "$OUT/$name.safetensors" >> "$OUT/$name.log" 2>&1
  $PY -m examples.shapes.evaluate --source "$run/export" --max-sequence-length 32 --prompts 128 \
    --grid "$OUT/$name-grid.png" > "$OUT/$name-eval.txt" 2>&1 &
done
wait
grep -h "sft step" "$OUT"/*.log | tail -40
for f in "$OUT"/*-eval.txt; do echo "== $f"; grep -A8 '"model"' "$f"; done
# one archive: a device call brings back only a few files
tar -czf "$OUT/shapes-build.tgz" -C "$OUT" --exclude shapes-build.tgz . && \
  find "$OUT" -type f ! -name shapes-build.tgz -delete
