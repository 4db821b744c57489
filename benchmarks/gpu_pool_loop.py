"""The shipped loop (``run_local``: the phase functions the Flyte tasks call) at recipe shapes on GPUs, in three
executions of the same steps: ``warm`` (one process, in-process phases, one GPU), ``pool-separate`` (a local Ray
pool: trainer actor on one GPU, engine actor on another, every version published over NCCL from the trainer's
tensors) and ``pool-colocate`` (trainer and engine actors sharing one GPU; publication through the object
store: NCCL refuses two ranks on one device) and ``pool-shared`` (``pool.placement: shared``, one GPU: one actor
process is trainer and engine, sampling with the trainer's module; one copy of the weights, no publish transfer),
and ``flyte-pool-shared`` / ``flyte-pool-colocate``: the workflow users run (``workflows/grpo.py::grpo``) executed
locally by flytekit, every phase a typed task handing its step to the pool (flytekit and Ray on a GPU machine
without them: ``gpu_carry_bundle.sh``). ``warm-quiet`` is a diagnostic of ``warm``: after each step the loop waits
for that step's background version write (``time/quiet_wait``), so no write runs beside the next rollout.

Per mode: the first step (model build, actor start, NCCL group set-up) and the median of the steady steps after
it, per phase; the pool's publication metrics (``pool/publish_send_s``, ``pool/publish_bytes``,
``pool/engines_serving``: engines whose served version equals the published one after every publish); the
rollout-vs-replay agreement the train phase measures (``train/ratio_min`` / ``max`` at the first update, the
log-prob absdiff where the algorithm reports one); peak memory per GPU from ``nvidia-smi`` sampled every 0.2 s
(each mode in a fresh process, so no mode inherits another's cache). Ratios are against ``warm`` in the same run.

Shapes (random init, bf16; the step-cost presets of ``bench_step_cost.py``): ``sd35m-lora`` (Flow-GRPO,
SD3.5-Medium-shaped transformer, 512 px, 10 steps, CFG 4.5, 2 prompts x 16, LoRA r32, gradient checkpointing,
micro-batch 8, EMA, KL 0.01) and ``qwen3-0.6b`` (GRPO, Qwen3-0.6B-shaped full fine-tune, 8 x 8 x 256 tokens).
Text encoders / VAE are replaced by seeded random embeddings and a cheap decode (``step_cost_shapes``); the pool's
actors get the same builder through ``pool.worker_setup_hook``.

  python benchmarks/gpu_pool_loop.py --preset sd35m-lora --steps 5          # two GPUs (separate needs both)
  OMP_NUM_THREADS=1 python benchmarks/gpu_pool_loop.py --preset sd35m-lora --smoke   # CPU plumbing check only
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
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("warm", "warm-quiet", "pool-separate", "pool-colocate", "pool-separate-lag1", "pool-shared",
         "flyte-pool-shared", "flyte-pool-colocate")
KEEP = ("time/", "pool/", "async/", "train/ratio", "train/logp", "train/absdiff", "rollout/logp", "reward/mean",
        "checkpoint/", "rollout/load_weights", "rollout/seconds", "rollout/tokens_per_s", "train/time_")


def _pool_overrides(mode: str, gpus: bool, cpus: float) -> list[str]:
    mode = mode.removeprefix("flyte-")
    sep, shared = mode.startswith("pool-separate"), mode == "pool-shared"
    g = ("1" if sep else "0.5") if gpus else "0"
    eg, tg = ("0", "1" if gpus else "0") if shared else (g, g)  # shared: the trainer's GPU is the engine's
    lag = ["async_training.max_policy_lag=1"] if mode.endswith("-lag1") else []
    placement = "shared" if shared else "separate" if sep else "colocate"
    return [*lag, "pool.execution=pool", f"pool.placement={placement}",
            f"pool.engine.num_gpus={eg}", f"pool.trainer.num_gpus={tg}", "pool.reward.num_gpus=0",
            f"pool.engine.num_cpus={cpus}", f"pool.trainer.num_cpus={cpus}", f"pool.reward.num_cpus={cpus}",
            "pool.worker_setup_hook=step_cost_shapes:worker_hook"]


class GpuMemory:
    """Peak ``memory.used`` per GPU (MiB) while it runs, from nvidia-smi (all processes: driver and actors)."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                return
            for line in out.strip().splitlines():
                i, used = (int(x) for x in line.split(","))
                self.peak[i] = max(self.peak.get(i, 0), used)
            self._stop.wait(0.2)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def _flyte_worker(mode: str, cfg_overrides: list[str], spec: dict, steps: int,
                  report_dir: Path) -> tuple[list[float], list[dict]]:
    """``flyte-pool-*``: the workflow users run (``workflows/grpo.py::grpo``), executed locally by flytekit in this
    process (every phase a flytekit task: typed inputs and outputs, Arrow batches, decks, the report), each task a
    thin client of the pool's actors. Step walls from the report's per-step records (written by each step's last
    task, at the step's end); the first from the execution's start (setup, init, the actors, step 1)."""
    import tasks.setup
    from workflows.grpo import grpo

    tasks.setup.preflight = lambda _cfg: []  # as for run_local: the shaped model is neither on the hub nor on disk
    t0 = time.time()
    out = grpo(recipe=spec["recipe"], overrides=cfg_overrides, max_steps=0)
    if out.step != steps:
        raise RuntimeError(f"{mode} ran to step {out.step}, expected {steps}")
    recs = [json.loads(f.read_text()) for f in sorted(report_dir.glob("step-*/metrics.json"))]
    ends = [t0] + [r["time"] for r in recs]
    return [b - a for a, b in zip(ends, ends[1:], strict=False)], [
        {k: float(v) for k, v in r["metrics"].items() if k.startswith(KEEP)} for r in recs]


def worker(mode: str, state: Path, steps: int) -> dict:
    """One mode in this (fresh) process: init the run, then ``run_local`` for ``steps`` steps."""
    import logging

    import torch

    from step_cost_shapes import SPEC_ENV, worker_hook

    spec = json.loads((state / "spec.json").read_text())
    os.environ[SPEC_ENV] = str(state)
    if spec["device"] == "cpu":
        torch.set_num_threads(1)
    logging.getLogger("unirl.progress").disabled = True
    worker_hook()  # this process (warm: the whole loop; pool: the driver's step-0 version)
    from unirl_core.config import load_recipe
    from unirl_core.loop import phases
    from unirl_core.loop import local
    from unirl_core.loop.local import run_local

    # the preflight checks the model reference against the hub / disk: a shaped random-init model is neither
    local.preflight = lambda _cfg: []

    overrides = [*spec["overrides"], f"checkpoint.root={state / mode}", f"loop.total_steps={steps}"]
    if not mode.startswith("warm"):
        overrides += _pool_overrides(mode, spec["device"] == "cuda", spec["actor_cpus"]) + spec["pool_overrides"]
    cfg = load_recipe(spec["recipe"], overrides)
    if mode.startswith("flyte-"):
        walls, records = _flyte_worker(mode, overrides, spec, steps, Path(cfg.checkpoint.root) / cfg.name / "report")
        from unirl_core.pool.cluster import close_pool

        close_pool()
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        return {"mode": mode, "init_s": 0.0, "step_wall_s": walls, "metrics": records,
                "driver_peak_allocated_gib": peak}
    t0 = time.perf_counter()
    phases.init_run(cfg, resume_from="never")
    init_s = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the pool driver keeps no model; its step-0 build is freed
    records: list[dict] = []
    stamps = [time.perf_counter()]

    def on_step(metrics, _batch):
        if mode == "warm-quiet":  # the step's version written before the next rollout starts (a diagnostic)
            tq = time.perf_counter()
            phases.finish_writes()
            metrics["time/quiet_wait"] = time.perf_counter() - tq
        stamps.append(time.perf_counter())
        records.append({k: float(v) for k, v in metrics.items() if k.startswith(KEEP)})

    run_local(cfg, on_step=on_step, progress=False)
    walls = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    if not mode.startswith("warm"):
        from unirl_core.pool.cluster import close_pool

        close_pool()
    return {"mode": mode, "init_s": init_s, "step_wall_s": walls, "metrics": records,
            "driver_peak_allocated_gib": peak}


def _spawn(mode: str, state: Path, steps: int, env: dict) -> dict:
    out = state / f"{mode}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--state", str(state),
           "--steps", str(steps), "--out", str(out)]
    with GpuMemory() as mem:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        return {"mode": mode, "error": f"exit {proc.returncode}", "process_s": wall, "gpu_peak_mib": mem.peak}
    res = json.loads(out.read_text())
    res.update(process_s=wall, gpu_peak_mib=mem.peak)
    return res


def _summary(res: dict) -> dict:
    if "error" in res:
        return res
    walls, ms = res["step_wall_s"], res["metrics"]
    steady = walls[1:] or walls
    phases = sorted({k for m in ms for k in m if k.startswith("time/")})
    per_phase = {k[5:]: statistics.median(m.get(k, 0.0) for m in ms[1:] or ms) for k in phases}
    pool = {k: [m[k] for m in ms if k in m] for k in sorted({k for m in ms for k in m
                                                            if k.startswith(("pool/", "async/"))})}
    first = ms[0] if ms else {}
    agree = {k: v for k, v in first.items() if k.startswith(("train/ratio", "train/logp", "train/absdiff",
                                                            "rollout/logp"))}
    trainer_idle = 1.0 - per_phase.get("train", 0.0) / max(statistics.median(steady), 1e-9)
    return {"mode": res["mode"], "trainer_idle_frac": trainer_idle, "init_s": res["init_s"],
            "first_step_s": walls[0], "steady_step_s":
            statistics.median(steady), "steady_steps": len(steady), "phases_s": per_phase, "pool": pool,
            "first_update": agree, "reward_mean": [m.get("reward/mean") for m in ms],
            "gpu_peak_mib": res["gpu_peak_mib"], "process_s": res["process_s"],
            "per_step": [{"wall_s": w, **{k: v for k, v in m.items() if k.startswith(("time/", "checkpoint/",
                                                                                      "rollout/", "train/time_"))}}
                         for w, m in zip(walls, ms, strict=False)]}


def run_preset(preset: str, args) -> dict:
    from bench_step_cost import PRESETS

    p = PRESETS[preset]
    device = "cpu" if args.smoke else "cuda"
    overrides = list(p["overrides"])
    if p["shaped"] == "sd35m":
        overrides.append(f"diffusion.model.device={device}")
        if args.smoke:
            overrides += ["diffusion.sampling.height=64", "diffusion.sampling.width=64",
                          "data.samples_per_prompt=2", "train.micro_batch_size=4",
                          "diffusion.engine.forward_batch_size=4"]
    else:
        overrides.append(f"lm.model.device={device}")
        if args.smoke:
            overrides += ["lm.sampling.max_new_tokens=8", "data.prompts_per_step=2", "data.samples_per_prompt=2",
                          "train.micro_batch_size=4", "lm.engine.forward_batch_size=4"]
    overrides += ["name=poolloop", "checkpoint.keep_last=2", *args.override]
    state = Path(tempfile.mkdtemp(prefix="unirl-poolloop-", dir=args.root))
    spec = {"preset": preset, "recipe": p["recipe"], "overrides": overrides, "device": device,
            "shaped": p["shaped"], "layers": 2 if args.smoke else None, "actor_cpus": 0.5 if args.smoke else 4,
            "pool_overrides": list(args.pool_override)}
    (state / "spec.json").write_text(json.dumps(spec, indent=1))
    from safetensors.torch import save_model

    from common import matmul_peak_tflops_in_child, mfu
    from step_cost_shapes import construct_shaped, step_model_flops
    from step_cost_worker import _config

    # MFU: the step's model FLOPs (meta device) over the steady step x the GPUs the mode holds x one GPU's peak
    flops = step_model_flops(spec, _config(dict(spec, overrides=[o.replace(f"device={device}", "device=cpu")
                                                                 for o in overrides])))
    peak_tflops = matmul_peak_tflops_in_child(device)
    t0 = time.perf_counter()
    save_model(construct_shaped(spec), str(state / "model-init.safetensors"))
    print(f"[{preset}] shaped weights written in {time.perf_counter() - t0:.1f} s", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), str(ROOT),
                                                                     os.environ.get("PYTHONPATH")])))
    results = []
    for mode in args.modes:
        one_gpu = not mode.startswith("pool-separate") and device == "cuda"
        m_env = dict(env, CUDA_VISIBLE_DEVICES="0") if one_gpu else env
        res = _summary(_spawn(mode, state, args.steps, m_env))
        if "error" not in res:
            res["gpus"] = 1 if one_gpu or device != "cuda" else 2
            res["mfu"] = mfu(flops, res["steady_step_s"] * res["gpus"], peak_tflops)
        results.append(res)
        if not args.keep_versions:  # a full fine-tune's versions are ~10 GB each: one mode's at a time on disk
            shutil.rmtree(state / mode, ignore_errors=True)
        print(f"[{preset}] {mode}: " + (res["error"] if "error" in res else
              f"first {res['first_step_s']:.2f} s, steady {res['steady_step_s']:.2f} s"), flush=True)
    if not args.keep:
        shutil.rmtree(state, ignore_errors=True)
    return {"preset": preset, "device": device, "steps": args.steps, "overrides": overrides,
            "pool_overrides": spec["pool_overrides"], "model_flops_per_step": flops, "peak_tflops": peak_tflops,
            "modes": results}


def _table(out: dict, cell: str) -> None:
    from common import fmt_mfu, report

    rows = []
    for pr in out["presets"]:
        warm = next((m for m in pr["modes"] if m["mode"] == "warm" and "error" not in m), None)
        for m in pr["modes"]:
            if "error" in m:
                rows.append([pr["preset"], m["mode"], m["error"], "", "", "", "", "", "", "", ""])
                continue
            ratio = f"{m['steady_step_s'] / warm['steady_step_s']:.3f}x" if warm else "-"
            equal = _rollout_equalised(m, warm)
            serving = m["pool"].get("pool/engines_serving")
            send = m["pool"].get("pool/publish_send_s")
            peak = ", ".join(f"{i}: {v / 1024:.1f}" for i, v in sorted(m["gpu_peak_mib"].items())) or "-"
            idle = m["pool"].get("async/engine_idle_frac")
            rows.append([pr["preset"], m["mode"], f"{m['first_step_s']:.2f}", f"{m['steady_step_s']:.2f}", ratio,
                         f"{equal:.3f}x" if equal is not None else "-",
                         f"{statistics.median(idle[1:] or idle):.2f}" if idle else "-",
                         f"{statistics.median(send):.3f}" if send else "-",
                         f"{min(serving):.0f}/{len(serving)} steps" if serving else "-", peak,
                         fmt_mfu(m.get("mfu"))])
    report("pool_loop", "The shipped loop in pool mode vs in-process, recipe shapes" + (" (SMOKE: CPU plumbing only)"
           if out["smoke"] else ""), ["preset", "mode", "first step s", "steady step s", "vs warm",
           "vs warm, warm's rollout", "engine idle frac", "publish send s", "engines serving (min)", "peak GiB per GPU",
           "MFU"], rows, out,
           notes=f"{out['presets'][0]['steps']} steps per mode, each mode a fresh process; steady = median of the "
                 "steps after the first; warm = run_local in one process on GPU 0; pool-separate = trainer and "
                 "engine actors on their own GPUs, NCCL publish; pool-colocate = both on GPU 0, object-store "
                 "publish; pool-shared = one actor on GPU 0 is trainer and engine (no publish transfer); -lag1 = "
                 "async_training.max_policy_lag 1 (rollout n+1 beside train n); flyte-pool-* = the same pool under the "
                 "Flyte workflow (flytekit local execution; step walls from the report's per-step records, the "
                 "last one including the end of the run). \"vs warm, warm's rollout\": the mode's steady step with its "
                 "median rollout replaced by warm's (the eager decode's speed moves ~1.6x from step to step on the "
                 "host, whatever runs beside it: warm-quiet), the ratio of the rest of the step. Peak = nvidia-smi "
                 "memory.used (all processes on that GPU). MFU: the step's model FLOPs (`step_cost_shapes.step_model_flops`) "
                 "over (steady step x the mode's GPUs x one GPU's measured bf16 matmul peak); `-` on a CPU.", cell=cell)


def _rollout_equalised(m: dict, warm: dict | None) -> float | None:
    """``m``'s steady step over warm's with ``m``'s median rollout replaced by warm's (None without a warm run or
    a rollout time)."""
    if warm is None or "rollout" not in m["phases_s"] or "rollout" not in warm["phases_s"]:
        return None
    return (m["steady_step_s"] - m["phases_s"]["rollout"] + warm["phases_s"]["rollout"]) / warm["steady_step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["sd35m-lora", "qwen3-0.6b"], choices=["sd35m-lora", "qwen3-0.6b"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, 2 layers, tiny sizes: plumbing only, not a result")
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--pool-override", action="append", default=[],
                    help="an override for the pool modes only (e.g. checkpoint.full_state=sharded, which in-process "
                         "execution refuses)")
    ap.add_argument("--root", default=None)
    ap.add_argument("--cell", default=None,
                    help="cell of results/pool_loop/latest.json this run replaces (default: default, or smoke)")
    ap.add_argument("--keep", action="store_true", help="keep the state dir (spec, per-mode JSON)")
    ap.add_argument("--keep-versions", action="store_true", help="also keep each mode's checkpoint versions")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Path(args.out).write_text(json.dumps(worker(args.worker, Path(args.state), args.steps)))
        return
    out = {"smoke": args.smoke, "presets": [run_preset(p, args) for p in args.preset]}
    _table(out, args.cell or ("smoke" if args.smoke else "default"))


if __name__ == "__main__":
    main()
