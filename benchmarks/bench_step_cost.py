"""What one loop step costs when every phase runs in a fresh process (as Flyte pods do), next to the warm
in-process loop (``run_local``), by component.

Pods mode: step k (k = 2, from version 1, so the optimizer state restored is a real one) runs as five fresh
``python benchmarks/step_cost_worker.py <phase> --state DIR`` processes in order, one per phase
(rollout, reward, advantage, train, publish). Each process times:

  start     interpreter start: the parent's spawn -> the first line of step_cost_worker.py (measured by the parent)
  flytekit  ``import flytekit`` (a pod imports it to run a task; only where it is installed, not on the GPU box)
  import    torch, unirl_core (loop, io, config) and the family's model library (diffusers / transformers)
  build     load_recipe + what the phase builds before it runs: the rollout bundle (and data set), the reward
            service, the train backend (model copy, fp32 masters, optimizer); GPU presets: model weights from a
            local safetensors file, plus stand-in loads (below)
  restore   checkpoint reads inside the phase: rollout ``load_policy_weights``, train
            ``restore_train_checkpoint`` (weights + optimizer state), advantage ``load_version_json`` (tracker),
            publish ``load_manifest``
  read      the input SampleBatch from the Arrow IPC file the previous phase wrote (``unirl_core.io.read_batch``)
  compute   the phase function (``unirl_core.loop.phases.*``) minus the restore / checkpoint write inside it
  write     outputs: Arrow IPC file + its sha256 (what the Flyte SampleBatch type does), or the checkpoint
            version (train, ``save_train_checkpoint`` inside ``train_phase``)
  exit      from the JSON report to process exit (interpreter / CUDA teardown; measured by the parent)

Warm mode: one long-lived process (worker ``warm``) builds everything, runs step k once as a warm-up, then
runs step k again ``--warm-repeats`` times calling the same phase functions in-process with the batch handed
over in memory (what ``run_local`` does); components are timed by the same wrappers. Rounds alternate warm and
pods; medians over rounds. Both modes start every round from the same version 1 and rewrite version 2
(``train_phase`` overwrites an unpublished/leftover version), so both do identical work: the per-step metrics
of the two modes are compared as a check (``same_result``).

Pool mode (``--pool``, default on for the tiny presets): one process with ``pool.execution=pool`` (a local Ray
head; engine, trainer and reward actors; weights published over a gloo group) runs a first step from version 1
(actor start + restore), then ``--warm-repeats`` chained steps, each from the version before (the pool's steady
state: trainer and engine resident); per-phase totals only, the components run inside the actors. Shaped GPU
presets patch the model builder in-process, which actor processes do not see: no pool timing for them.

Bytes written to the artifact store per step: pods = the three Arrow files (rollout, reward, advantage) + the
checkpoint version; pool = the three projection Arrow files (``unirl_core.pool.projection``: no latents, no
replay conditions) + the checkpoint version, measured in pool mode, or (shaped presets) the projections of the
pods batches, written untimed by the pods workers; warm = the checkpoint version.

Presets:
  tiny-grpo, tiny-flow-grpo   the shipped recipes on CPU (default: both), checkpoint root in a temp dir.
  sd35m-lora, sd35m-full      Flow-GRPO, SD3.5-Medium-shaped transformer (random init, bf16, 512 px, 10 steps,
                              CFG 4.5, 2 prompts x 16 samples, micro-batch 8, gradient checkpointing; LoRA
                              r32 + EMA + tracker + KL 0.01 like sd35m-pickscore, or full fine-tune with the
                              tracker but without EMA / KL reference).
  qwen3-0.6b                  GRPO, Qwen3-0.6B-shaped LM (random init, bf16, full fine-tune, full-scope
                              checkpoints), 8 prompts x 8 samples x 256 new tokens, forward and micro-batch 16 (as qwen3-math).

GPU presets cannot use ``from_pretrained`` (no hub access): every process (setup, warm, pods) replaces
``unirl_core.runtime.build.fresh_bundle`` with a builder that constructs the model of the real shape on the device
(random init, fixed seed; sub-component ``construct``) and then loads the same weights from a local safetensors
file written once by the setup process (``load``), which stands in for from_pretrained's load. SD3.5-M bundles
have no text encoders or VAE: prompts encode to seeded random embeddings of the real shapes (77 + 256 tokens x
4096, pooled 2048) and images decode to a cheap latent->RGB 512 px PNG; the load those components would cost
is measured by loading a safetensors file of their real size (T5-XXL + CLIP-L + CLIP-G + VAE, 11.3 GB) in the
rollout process, and a PickScore-sized file (CLIP-H, 2.0 GB) in the reward process (the reward computed is
jpeg_compressibility). With ``--cold-cache`` (default) the model / stand-in / checkpoint / Arrow files are
evicted from the page cache (fsync + posix_fadvise DONTNEED, best effort) before every pods process, so their
reads come from disk rather than memory; a real pod reads them from object storage or a network volume.

  OMP_NUM_THREADS=1 python benchmarks/bench_step_cost.py                          # CPU: tiny-grpo, tiny-flow-grpo
  python benchmarks/bench_step_cost.py --preset sd35m-lora --device cuda          # one H200
  python benchmarks/bench_step_cost.py --preset qwen3-0.6b --device cuda          # one H200
  python benchmarks/bench_step_cost.py --preset sd35m-full --device cuda          # ~100 GB free disk (nvidia-h200-x2)
  OMP_NUM_THREADS=1 python benchmarks/bench_step_cost.py --preset sd35m-lora --smoke   # CPU smoke, not a result
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
COMPONENTS = ("start", "flytekit", "import", "build", "restore", "read", "compute", "write", "exit")

# benchmarks/ is the script's folder: on sys.path
from step_cost_shapes import PICKSCORE_BYTES, SD35M_ENCODERS_BYTES  # noqa: E402
from step_cost_worker import MARK, PHASES, RUN, STEP  # noqa: E402

PRESETS: dict[str, dict] = {
    "tiny-grpo": {"recipe": "tiny-grpo", "device": "cpu", "rounds": 5, "warm_repeats": 3, "overrides": []},
    "tiny-flow-grpo": {"recipe": "tiny-flow-grpo", "device": "cpu", "rounds": 5, "warm_repeats": 3, "overrides": []},
    "sd35m-lora": {
        "recipe": "tiny-flow-grpo", "device": "cuda", "rounds": 1, "warm_repeats": 1, "shaped": "sd35m",
        "standins": {"rollout": SD35M_ENCODERS_BYTES, "reward": PICKSCORE_BYTES},
        "overrides": ["diffusion.model.source=sd35m-shaped", "diffusion.model.dtype=bfloat16",
                   "diffusion.model.finetune=lora", "diffusion.model.lora={rank: 32, alpha: 64.0}",
                   "diffusion.model.gradient_checkpointing=true", "diffusion.sampling.noise_level=0.7",
                   "diffusion.sampling.guidance_scale=4.5", "diffusion.sampling.height=512",
                   "diffusion.sampling.width=512", "diffusion.engine.forward_batch_size=8",
                   "diffusion.algorithm.clip_range=1.0e-4", "diffusion.algorithm.kl_beta=0.01",
                   "diffusion.algorithm.timestep_fraction=0.99", "data.prompts_per_step=2",
                   "data.samples_per_prompt=16", "advantage.std_scope=global",
                   "tracker={buffer_size: 32, min_count: 16}", "train.lr=3.0e-4", "train.weight_decay=1.0e-4",
                   "train.micro_batch_size=8", "train.ema_decay=0.99"]},
    "sd35m-full": {
        "recipe": "tiny-flow-grpo", "device": "cuda", "rounds": 1, "warm_repeats": 1, "shaped": "sd35m",
        "standins": {"rollout": SD35M_ENCODERS_BYTES, "reward": PICKSCORE_BYTES},
        "overrides": ["diffusion.model.source=sd35m-shaped", "diffusion.model.dtype=bfloat16",
                   "diffusion.model.finetune=full", "diffusion.model.reference_copy=false",
                   "diffusion.model.gradient_checkpointing=true", "diffusion.sampling.noise_level=0.7",
                   "diffusion.sampling.guidance_scale=4.5", "diffusion.sampling.height=512",
                   "diffusion.sampling.width=512", "diffusion.engine.forward_batch_size=8",
                   "diffusion.algorithm.clip_range=1.0e-4", "diffusion.algorithm.kl_beta=0.0",
                   "diffusion.algorithm.timestep_fraction=0.99", "data.prompts_per_step=2",
                   "data.samples_per_prompt=16", "advantage.std_scope=global",
                   "tracker={buffer_size: 32, min_count: 16}", "train.lr=1.0e-5", "train.weight_decay=1.0e-4",
                   "train.micro_batch_size=8"]},
    "qwen3-0.6b": {
        "recipe": "tiny-grpo", "device": "cuda", "rounds": 1, "warm_repeats": 1, "shaped": "qwen3-0.6b",
        "standins": {}, "overrides": ["lm.model.model=qwen3-0.6b-shaped", "lm.model.dtype=bfloat16", "lm.model.finetune=full",
                   "lm.model.keep_reference=false", "lm.sampling.max_new_tokens=256",
                   "lm.engine.forward_batch_size=16", "lm.engine.apply_chat_template=false",
                   "data.prompts_per_step=8", "data.samples_per_prompt=8", "train.lr=1.0e-6",
                   "train.micro_batch_size=16", "train.weights_scope=full"]},
}



def _evict(paths: list[Path]) -> None:
    """Drop files from the page cache (fsync, then POSIX_FADV_DONTNEED): best effort, no privileges needed."""
    if not hasattr(os, "posix_fadvise"):
        return
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
        for f in files:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def _spawn(worker: str, state: Path, extra: list[str] = ()) -> tuple[dict, float, float]:
    """Run a worker process; returns its report, the spawn wall time and the exit wall time."""
    cmd = [sys.executable, str(HERE / "step_cost_worker.py"), worker, "--state", str(state), *extra]
    spawn = time.time()
    # the worker's stderr (its progress lines, warnings, a traceback) goes straight to ours: a run cut by a time
    # limit still shows how far each worker got
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=str(ROOT), check=False)
    end = time.time()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"worker {worker} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len(MARK):]), spawn, end


def _pods_round(state: Path, cold: bool) -> dict:
    pods = state / "pods"
    shutil.rmtree(pods, ignore_errors=True)
    pods.mkdir()
    out: dict = {"phases": {}, "metrics": {}}
    ckpt_dir = state / "ckpt"
    for phase in PHASES:
        if cold:
            _evict([ckpt_dir, pods, *state.glob("*.safetensors")])
        r, spawn, end = _spawn(phase, state)
        t = {k: v for k, v in r["t"].items()}
        comps = {c: t.get(c, 0.0) for c in COMPONENTS}
        comps["start"] = r["t0_wall"] - spawn
        comps["exit"] = end - r["end_wall"]
        comps["total"] = end - spawn
        print(f"  [pods] {phase} process {comps['total']:.1f} s", file=sys.stderr, flush=True)
        comps.update({k: v for k, v in t.items() if "." in k})  # build.* sub-components
        comps["bytes_written"] = r["bytes_written"]
        comps["projection_bytes"] = r.get("projection_bytes", 0)
        out["phases"][phase] = comps
        out["metrics"].update(r["metrics"])
    out["total"] = sum(p["total"] for p in out["phases"].values())
    out["bytes_written"] = sum(p["bytes_written"] for p in out["phases"].values())
    out["arrow_bytes"] = {p: out["phases"][p]["bytes_written"] for p in ("rollout", "reward", "advantage")}
    out["projection_bytes"] = {p: r_bytes for p in ("rollout", "reward", "advantage")
                               if (r_bytes := out["phases"][p].pop("projection_bytes", 0))}
    return out


def _median_components(rounds: list[dict]) -> dict:
    """Component-wise medians per phase over rounds (each round: phase -> component -> seconds)."""
    med = {}
    for phase in PHASES:
        keys = [k for k in rounds[0][phase] if isinstance(rounds[0][phase][k], float)]
        med[phase] = {k: statistics.median(r[phase].get(k, 0.0) for r in rounds) for k in keys}
    return med


def _step_medians(steps: list[dict]) -> dict:
    """Phase -> component medians over in-process steps, plus ``_step``: the median step total."""
    med = {ph: {k: statistics.median(st[ph].get(k, 0.0) for st in steps) for k in steps[0][ph]} for ph in PHASES}
    med["_step"] = statistics.median(sum(st[ph]["total"] for ph in PHASES) for st in steps)
    return med


def _same_result(a: dict, b: dict) -> dict:
    """Every non-timing metric of the two modes' step k (same version, same seeds: equal on CPU)."""
    timing = ("time", "seconds", "_s", "per_s")
    keys = sorted(k for k in set(a) & set(b) if not any(t in k for t in timing))
    diffs = {k: abs(a[k] - b[k]) for k in keys if a[k] == a[k] and b[k] == b[k]}
    worst = max(diffs, key=diffs.get) if diffs else None
    return {"keys_compared": len(keys), "max_abs_diff": diffs[worst] if worst else 0.0, "worst_key": worst}


def run_preset(name: str, args) -> None:
    from common import fmt_mfu, matmul_peak_tflops_in_child, mfu, report
    from step_cost_shapes import step_model_flops
    from step_cost_worker import _config

    p = dict(PRESETS[name])
    device = args.device or p["device"]
    rounds = args.rounds or p["rounds"]
    warm_repeats = args.warm_repeats or p["warm_repeats"]
    family = "diffusion" if "flow" in p["recipe"] else "lm"
    overrides = list(p["overrides"])
    if p.get("shaped") == "sd35m":
        overrides.append(f"diffusion.model.device={device}")
    if args.height and family == "diffusion":
        overrides += [f"diffusion.sampling.height={args.height}", f"diffusion.sampling.width={args.height}"]
    if args.new_tokens and family == "lm":
        overrides.append(f"lm.sampling.max_new_tokens={args.new_tokens}")
    if args.prompts:
        overrides.append(f"data.prompts_per_step={args.prompts}")
    if args.samples:
        overrides.append(f"data.samples_per_prompt={args.samples}")
        if p.get("shaped") == "sd35m":  # the stored log-probs are exact over the engine's slices
            mb = min(8, args.samples * (args.prompts or 2))
            overrides += [f"train.micro_batch_size={mb}", f"diffusion.engine.forward_batch_size={mb}"]
        elif p.get("shaped"):
            mb = min(16, args.samples * (args.prompts or 8))
            overrides += [f"train.micro_batch_size={mb}", f"lm.engine.forward_batch_size={mb}"]
    overrides += list(args.override)
    smoke = bool(args.smoke or args.layers or args.height or args.standin_scale is not None)
    base = Path(args.root) if args.root else None
    state = Path(tempfile.mkdtemp(prefix="unirl-stepcost-", dir=base))
    overrides += [f"checkpoint.root={state / 'ckpt'}", f"name={RUN}", "checkpoint.keep_last=2"]
    spec = {"preset": name, "recipe": p["recipe"], "overrides": overrides, "device": device, "family": family,
            "shaped": p.get("shaped"), "standins": p.get("standins", {}), "layers": args.layers,
            "standin_scale": args.standin_scale if args.standin_scale is not None else 1.0}
    (state / "spec.json").write_text(json.dumps(spec, indent=1))
    # MFU: the step's model FLOPs (counted on the meta device, shaped presets only) and this GPU's matmul peak,
    # measured in a child before the workers start
    flops = step_model_flops(spec, _config(dict(spec, overrides=[o.replace(f"device={device}", "device=cpu")
                                                                 for o in overrides])))
    peak_tflops = matmul_peak_tflops_in_child(device)
    try:
        print(f"[{name}] setup (step-0 version, step 1 in-process) in {state}", flush=True)
        setup, _, _ = _spawn("setup", state)
        warm_rounds, pods_rounds, ratios, warm_info = [], [], [], None
        use_pool = args.pool if args.pool is not None else not p.get("shaped")
        pool_rounds, pool_info = [], None
        for r in range(rounds):
            w, _, _ = _spawn("warm", state, ["--warm-repeats", str(warm_repeats)])
            steps = [{ph: s[ph] for ph in PHASES} for s in w["steps"]]
            wr = {ph: {k: statistics.median(s[ph].get(k, 0.0) for s in steps) for k in steps[0][ph]} for ph in PHASES}
            warm_total = statistics.median(sum(s[ph]["total"] for ph in PHASES) for s in steps)
            pr = _pods_round(state, args.cold_cache)
            pods_rounds.append(pr)
            warm_rounds.append(wr)
            ratios.append(pr["total"] / warm_total)
            warm_info = w
            print(f"[{name}] round {r + 1}/{rounds}: pods step {pr['total']:.2f} s, warm step {warm_total:.2f} s, "
                  f"ratio {ratios[-1]:.1f}x", flush=True)
            if use_pool:
                pool_info, _, _ = _spawn("pool", state, ["--warm-repeats", str(warm_repeats)])
                pool_rounds.append(_step_medians(pool_info["steps"]))
                print(f"[{name}] round {r + 1}/{rounds}: pool step {pool_rounds[-1]['_step']:.2f} s "
                      f"(first pool step {pool_info['first_step_s']:.2f} s)", flush=True)
        pods_med = _median_components([pr["phases"] for pr in pods_rounds])
        warm_med = _median_components(warm_rounds)
        check = _same_result(pods_rounds[-1]["metrics"], warm_info["metrics"])
        version_bytes = warm_info["version_bytes"]
        arrow = pods_rounds[-1]["arrow_bytes"]
    except BaseException:
        if not args.keep:
            shutil.rmtree(state, ignore_errors=True)
        raise
    rows = []
    fmt = lambda x: f"{x:.3f}" if x < 10 else f"{x:.1f}"
    for ph in PHASES:
        pm, wm = pods_med[ph], warm_med[ph]
        rows.append([ph, "pods", *[fmt(pm.get(c, 0.0)) for c in COMPONENTS], fmt(pm["total"]),
                     f"{pm['total'] / max(wm['total'], 1e-9):.1f}x", ""])
        rows.append(["", "warm", *[fmt(wm.get(c, 0.0)) if c in wm else "-" for c in COMPONENTS],
                     fmt(wm["total"]), "", ""])
    pods_step = statistics.median(pr["total"] for pr in pods_rounds)
    warm_step = statistics.median(sum(w[ph]["total"] for ph in PHASES) for w in warm_rounds)
    tot = lambda med, c: sum(med[ph].get(c, 0.0) for ph in PHASES)
    rows.append(["step", "pods", *[fmt(tot(pods_med, c)) for c in COMPONENTS], fmt(pods_step),
                 f"{statistics.median(ratios):.1f}x", fmt_mfu(mfu(flops, pods_step, peak_tflops))])
    rows.append(["", "warm", *[fmt(tot(warm_med, c)) if any(c in warm_med[ph] for ph in PHASES) else "-"
                               for c in COMPONENTS],
                 fmt(warm_step), "", fmt_mfu(mfu(flops, warm_step, peak_tflops))])
    if pool_rounds:
        pool_med = _median_components(pool_rounds)
        pool_step = statistics.median(r["_step"] for r in pool_rounds)
        for i, ph in enumerate(PHASES):
            rows.insert(3 * i + 2, ["", "pool", *["-"] * len(COMPONENTS), fmt(pool_med[ph]["total"]),
                                    f"{pool_med[ph]['total'] / max(warm_med[ph]['total'], 1e-9):.2f}x warm", ""])
        rows.append(["", "pool", *["-"] * len(COMPONENTS), fmt(pool_step), f"{pool_step / warm_step:.2f}x warm",
                     fmt_mfu(mfu(flops, pool_step, peak_tflops))])
        last = pool_info["bytes_per_step"][-1]
        pool_bytes = sum(last["arrow"].values()) + last["checkpoint_version"]
        pool_source = "measured in pool mode"
    else:
        pool_med, pool_step = None, None
        projection = pods_rounds[-1]["projection_bytes"]
        pool_bytes = sum(projection.values()) + version_bytes
        pool_source = "projections of the pods batches + the checkpoint version"
    pods_bytes = sum(arrow.values()) + version_bytes
    mb = lambda n: f"{n / 1e3:.0f} kB" if n < 1e6 else f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"
    header = ["phase", "mode", *COMPONENTS, "total s", "pods/warm", "MFU"]
    sub = {ph: pods_med[ph] for ph in PHASES}
    data = {"preset": name, "recipe": p["recipe"], "overrides": [o for o in overrides if not o.startswith(
        ("checkpoint.root=", "name="))], "device": device, "step": STEP, "rounds": rounds,
            "warm_repeats": warm_repeats, "cold_cache": args.cold_cache, "smoke": smoke,
            "pods_step_s": pods_step, "warm_step_s": warm_step, "ratio_pods_over_warm": statistics.median(ratios),
            "ratios_per_round": ratios, "pods_median": sub, "warm_median": warm_med,
            "bytes_written_per_step": {"pods": pods_bytes, "warm": version_bytes, "arrow": arrow,
                                       "checkpoint_version": version_bytes, "pool": pool_bytes,
                                       "pool_source": pool_source,
                                       "pool_arrow": (pool_info["bytes_per_step"][-1]["arrow"] if pool_rounds
                                                      else pods_rounds[-1]["projection_bytes"])},
            "pool_step_s": pool_step, "pool_median": pool_med,
            "model_flops_per_step": flops, "peak_tflops": peak_tflops, "mfu": mfu(flops, warm_step, peak_tflops),
            "pods_mfu": mfu(flops, pods_step, peak_tflops),
            "pool_mfu": mfu(flops, pool_step, peak_tflops) if pool_step else None,
            "pool_first_step_s": pool_info["first_step_s"] if pool_info else None,
            "same_result_pool": _same_result(pods_rounds[-1]["metrics"], pool_info["metrics"]) if pool_info
            else None,
            "same_result_check": check, "setup": {"setup_s": setup["setup_s"]},
            "warm_first_step_s": warm_info["warmup_step_s"], "raw": {"pods": pods_rounds, "warm": warm_rounds}}
    subs = sorted({k for ph in PHASES for k in pods_med[ph] if "." in k})
    sub_note = ("; sub-components of build (pods, medians): " + ", ".join(
        f"{ph} {k.split('.', 1)[1]} {pods_med[ph][k]:.2f} s" for ph in PHASES for k in subs if k in pods_med[ph])
                ) if subs else ""
    notes = (f"Step {STEP} of `{p['recipe']}`{' (' + name + ' shape)' if p.get('shaped') else ''} on {device}: "
             f"pods = one fresh `python` process per phase (as a Flyte pod), warm = the same phase functions in one "
             f"process after a warm-up step (`run_local`). Medians over {rounds} round(s) (warm: {warm_repeats} "
             f"step(s) per round); ratio = median of per-round pods/warm step wall. Components: start = interpreter "
             "start, flytekit = `import flytekit` (where installed), import = torch + unirl_core + model library, "
             "build = config + models/services (+ stand-ins), restore = checkpoint reads inside the phase, read/write = "
             "Arrow IPC (+ sha256, as the Flyte type) or checkpoint version, compute = phase function minus its "
             "checkpoint IO, exit = report -> process exit. Bytes written to the artifact store per step: pods "
             f"{mb(pods_bytes)} (Arrow {', '.join(f'{k} {mb(v)}' for k, v in arrow.items())}; checkpoint version "
             f"{mb(version_bytes)}), pool {mb(pool_bytes)} ({pool_source}), warm {mb(version_bytes)}. "
             + (f"Pool = `pool.execution=pool` (local Ray head, engine / trainer / reward actors, projection "
                f"emitted, weights broadcast over gloo), chained steps {STEP + 1}.. after a first step from version "
                f"1 ({pool_info['first_step_s']:.2f} s incl. actor start); per-phase totals only (the components "
                "run inside the actors). " if pool_rounds else "") + f"The warm process's first (cold) step took "
             f"{warm_info['warmup_step_s']:.2f} s. Same-result check pods vs warm: {check['keys_compared']} metrics, "
             f"max abs diff {check['max_abs_diff']:.3g}. Page cache {'evicted' if args.cold_cache else 'kept'} "
             "before each pod (best effort). Not modelled: pod scheduling / image pull / container start, "
             "flytekit literal conversion and blob upload/download (see bench_orchestration), the report task (and "
             f"join_shards with more than one rollout shard){sub_note}. MFU (step rows, shaped presets): the step's "
             "model FLOPs (generation / CFG rollout forwards + the trained forward and backward + a KL reference "
             "forward; `step_cost_shapes.step_model_flops`) over the step time and this GPU's measured bf16 matmul "
             "peak (`-` on a CPU or a tiny preset).")
    suffix = "_smoke" if smoke else ""
    report("step_cost",
           f"Step cost by component: fresh process per phase (pods) vs warm in-process loop ({name}, {device})",
           header, rows, data, notes, cell=f"{name}_{device.split(':')[0]}{suffix}")
    if not args.keep:  # after the report: deleting a full fine-tune's state takes a while
        shutil.rmtree(state, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=["tiny-grpo", "tiny-flow-grpo"])
    ap.add_argument("--device", default=None, help="default: the preset's (cpu for tiny-*, cuda otherwise)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warm-repeats", type=int, default=None)
    ap.add_argument("--root", default=None, help="folder for the state dir (checkpoints, Arrow files, weights)")
    ap.add_argument("--keep", action="store_true", help="keep the state dir")
    ap.add_argument("--cold-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="evict model / checkpoint / Arrow files from the page cache before each pod")
    ap.add_argument("--pool", action=argparse.BooleanOptionalAction, default=None,
                    help="also time pool mode (default: on for the tiny presets; shaped presets patch the model "
                         "builder in-process, which Ray's actor processes do not see)")
    ap.add_argument("--smoke", action="store_true", help="GPU presets on CPU with tiny shapes (not a result)")
    ap.add_argument("--layers", type=int, default=None, help="shaped presets: fewer layers (smoke)")
    ap.add_argument("--height", type=int, default=None, help="diffusion: image size (smoke)")
    ap.add_argument("--new-tokens", type=int, default=None, help="lm: max new tokens")
    ap.add_argument("--prompts", type=int, default=None, help="data.prompts_per_step")
    ap.add_argument("--samples", type=int, default=None, help="data.samples_per_prompt")
    ap.add_argument("--standin-scale", type=float, default=None, help="scale the stand-in file sizes (smoke)")
    ap.add_argument("--override", action="append", default=[], help="extra recipe override a.b=value")
    args = ap.parse_args()
    if args.smoke:  # tiny shapes of the GPU presets, on CPU
        args.device = args.device or "cpu"
        args.layers = args.layers or 1
        args.height = args.height or 64
        args.new_tokens = args.new_tokens or 8
        args.prompts = args.prompts or 1
        args.samples = args.samples or 4
        args.standin_scale = 1e-3 if args.standin_scale is None else args.standin_scale
        args.rounds = args.rounds or 1
        args.warm_repeats = args.warm_repeats or 1
    sys.path.insert(0, str(HERE))
    for name in args.preset:
        if (args.device or PRESETS[name]["device"]) == "cpu":  # workers inherit it: one thread on a shared box
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            os.environ.setdefault("MKL_NUM_THREADS", "1")
        run_preset(name, args)


if __name__ == "__main__":
    main()
