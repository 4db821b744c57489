"""One-GPU check of the trainer -> engine weight sync and of FSDP2 at world size 1 (no pytest).

1. ``nccl_same_gpu``: trainer + engine process on cuda:0 over NCCL. NCCL normally refuses two ranks on
   one device; the error text is recorded (that is a result, not a crash of this script).
2. ``gloo_cuda``: the same code over gloo with CUDA tensors on both sides; if gloo refuses CUDA tensors,
   ``gloo_cpu_staging`` runs instead (sync group on CPU, modules on the GPU: packing stages through host).
   Each sync check sends the tiny LM's full weights twice (changed in between) and compares bit-exactly.
3. ``fsdp_world1``: ``torchrun --nproc_per_node 1`` runs a TrainBackend step with ``shard="always"``
   (FSDP2 applied at world size 1, bf16) next to ``shard="never"`` on the same model and batch, and gathers
   the sharded module's full weights the way the weight sync does.

Depends on torch + transformers + this repo; < 3 min on an H200. Writes <out-dir>/gpu_weight_sync_check.{json,md}.
Run: python benchmarks/gpu_weight_sync_check.py [--out-dir DIR]   # writes DIR/weight_sync_check/latest.*
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "OMP_NUM_THREADS": "1"}
os.environ.update({k: os.environ.get(k, v) for k, v in GPU_ENV.items()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_version() -> str:
    import torch

    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _tiny_lm(seed: int, device: str):
    from unirl_core.models.lm import build_tiny_lm

    return build_tiny_lm(seed=seed, keep_reference=False).module.to(device)


def engine_role(args) -> None:
    """Receive until the sender closes; save every version's state for the trainer to compare."""
    import torch

    from unirl_core.weightsync.sync import WeightReceiver, WeightSyncConfig

    module = _tiny_lm(7, args.module_device)
    cfg = WeightSyncConfig(master_port=args.port, backend=args.backend, timeout_s=60)
    with WeightReceiver(cfg, module, device=args.sync_device) as rx:
        while (stats := rx.receive()) is not None:
            torch.save({k: v.cpu() for k, v in module.state_dict().items()}, Path(args.tmp) / f"v{stats.version}.pt")


def sync_check(backend: str, sync_device: str, tmp: Path, module_device: str) -> dict:
    """Sender and engine each in a child process (an NCCL failure may abort its process); the result is
    the sender child's JSON, or its exit code and log when it died."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), **GPU_ENV)
    cmd = [sys.executable, __file__, "--role", "trainer", "--backend", backend, "--sync-device", sync_device,
           "--module-device", module_device, "--tmp", str(tmp)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    except subprocess.TimeoutExpired as e:
        return {"ok": False, "backend": backend, "sync_device": sync_device, "error": f"hung for 240 s: {e}"}
    if (tmp / "result.json").exists():
        return json.loads((tmp / "result.json").read_text())
    return {"ok": False, "backend": backend, "sync_device": sync_device,
            "error": f"trainer process rc={proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"}


def trainer_role(args) -> None:
    """Sender here, engine in a child; two full-weight syncs, bit-exact comparison -> tmp/result.json."""
    import torch

    from unirl_core.weightsync.sync import (
        WeightSender,
        WeightSyncConfig,
        gather_for_sync,
    )

    backend, sync_device, tmp = args.backend, args.sync_device, Path(args.tmp)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), **GPU_ENV)
    child = subprocess.Popen([sys.executable, __file__, "--role", "engine", "--port", str(port), "--backend", backend,
                              "--sync-device", sync_device, "--module-device", args.module_device,
                              "--tmp", str(tmp)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: dict = {"backend": backend, "sync_device": sync_device, "module_device": args.module_device}
    module = _tiny_lm(0, args.module_device)
    sent, secs = {}, []
    try:
        with WeightSender(WeightSyncConfig(master_port=port, backend=backend, timeout_s=60), device=sync_device) as tx:
            for version in (1, 2):
                with torch.no_grad():
                    for p in module.parameters():
                        p.add_(torch.randn_like(p) * 0.01)
                secs.append(tx.send(gather_for_sync(module, "full"), version).seconds)
                sent[version] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    except Exception as e:  # noqa: BLE001 - the error text is the result of this check
        out.update(ok=False, error=f"{type(e).__name__}: {e}")
    try:
        log, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        log, _ = child.communicate()
    out["engine_rc"] = child.returncode
    out["engine_log_tail"] = log[-1500:]
    if "error" not in out:
        mism = []
        for version, state in sent.items():
            got = torch.load(tmp / f"v{version}.pt", weights_only=True)
            mism += [f"v{version}:{k}" for k, v in state.items() if not torch.equal(got[k], v)]
        out.update(ok=not mism and child.returncode == 0, mismatches=mism[:5], sync_seconds=secs,
                   tensors=len(sent[1]))
    (tmp / "result.json").write_text(json.dumps(out))


def fsdp_role(args) -> None:
    """Under torchrun (world 1): shard='always' vs 'never' on the same Qwen2 model and batch."""
    import copy

    import torch

    from benchmarks.bench_train import (
        PRESETS,
        ModelPolicy,
        TokenGRPO,
        build_model,
        make_batch,
    )
    from unirl_core.train import TrainBackend, TrainConfig, init_distributed
    from unirl_core.weightsync.sync import gather_for_sync

    info = init_distributed()
    dev = info.device
    p = PRESETS["small" if dev.type == "cuda" else "tiny"]
    model = build_model(p, dev)
    algo = TokenGRPO(p["prompt"], dev)
    batch = make_batch(p, model, algo)
    result = {"world_size_env": os.environ.get("WORLD_SIZE"), "device": str(dev)}
    for shard in ("never", "always"):
        cfg = TrainConfig(lr=1e-5, micro_batch_size=p["micro"], shard=shard,
                          fsdp_wrap_classes=("Qwen2DecoderLayer",) if shard == "always" else ())
        # the compute dtype is the model's: bf16 on CUDA (fp32 masters of the trainable weights), fp32 on CPU
        low = copy.deepcopy(model).to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
        be = TrainBackend(ModelPolicy(low), algo, cfg, dist_info=info)
        t0 = time.perf_counter()
        losses = [be.step(batch).loss for _ in range(3)]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        full = gather_for_sync(be.policy.module, "full")
        result[shard] = {"sharded": be.sharded, "losses": losses, "seconds_3_steps": time.perf_counter() - t0,
                         "sync_tensors": len(full),
                         "sync_shapes_full": all(tuple(full[k].shape) == tuple(v.shape)
                                                 for k, v in model.state_dict().items())}
        result[shard]["weights"] = {k: v.float().cpu() for k, v in full.items()}
    a, b = result["never"].pop("weights"), result["always"].pop("weights")
    result["max_abs_weight_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    result["loss_diff_step1"] = abs(result["never"]["losses"][0] - result["always"]["losses"][0])
    Path(args.tmp).write_text(json.dumps(result))


def fsdp_check(tmp: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), **GPU_ENV)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", __file__,
           "--role", "fsdp", "--tmp", str(tmp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode:
        return {"ok": False, "error": proc.stderr[-3000:]}
    r = json.loads(tmp.read_text())
    r["ok"] = bool(r["always"]["sharded"] and not r["never"]["sharded"] and r["always"]["sync_shapes_full"]
                   and r["world_size_env"] == "1")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--cpu-smoke", action="store_true", help="run the gloo and FSDP checks on CPU (no GPU)")
    ap.add_argument("--role", default="main", choices=("main", "engine", "trainer", "fsdp"), help=argparse.SUPPRESS)
    ap.add_argument("--module-device", default="cuda:0", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)
    ap.add_argument("--sync-device", default="cuda:0", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "engine":
        return engine_role(args)
    if args.role == "fsdp":
        return fsdp_role(args)
    if args.role == "trainer":
        return trainer_role(args)
    import tempfile

    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        raise SystemExit("needs a CUDA GPU (or --cpu-smoke)")
    gpu = not args.cpu_smoke
    dev = "cuda:0" if gpu else "cpu"
    res: dict = {"gpu": torch.cuda.get_device_name(0) if gpu else "none (cpu smoke)", "torch": torch.__version__,
                 "nccl": _nccl_version() if gpu else "-", "env": GPU_ENV}
    checks = [("nccl_same_gpu", lambda: sync_check("nccl", "cuda:0", tmp / "nccl", dev))] if gpu else []
    checks += [("gloo_cuda", lambda: sync_check("gloo", dev, tmp / "gloo_cuda", dev)),
               ("fsdp_world1", lambda: fsdp_check(tmp / "fsdp.json"))]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, fn in checks:
            try:
                res[name] = fn()
            except Exception as e:  # noqa: BLE001 - record and go on to the next check
                res[name] = {"ok": False, "error": "".join(traceback.format_exception(e))[-3000:]}
            if name == "gloo_cuda" and not res[name].get("ok"):
                res["gloo_cpu_staging"] = sync_check("gloo", "cpu", tmp / "gloo_cpu", dev)
            print(name, "ok" if res[name].get("ok") else "FAILED", flush=True)
    res["seconds"] = time.perf_counter() - t0
    lines = ["### Weight sync + FSDP2 world-1 check (one GPU)", "", "| check | ok | detail |", "|---|---|---|"]
    for name in ("nccl_same_gpu", "gloo_cuda", "gloo_cpu_staging", "fsdp_world1"):
        if name in res:
            r = res[name]
            detail = r.get("error", "").splitlines()[-1][:160] if r.get("error") else (
                f"sync s {[round(s, 4) for s in r['sync_seconds']]}" if "sync_seconds" in r else
                f"losses never {r['never']['losses']} / always {r['always']['losses']}, "
                f"max |dw| {r['max_abs_weight_diff']:.2e}")
            lines.append(f"| {name} | {r.get('ok')} | {detail.replace('|', '/')} |")
    lines += ["", f"_{res['gpu']}, torch {res['torch']}, NCCL {res['nccl']}, {res['seconds']:.0f} s._", ""]
    print("\n".join(lines))
    if gpu:  # the CPU smoke is plumbing only: no record
        from benchmarks.common import write_record

        print(f"wrote {write_record('weight_sync_check', res, chr(10).join(lines), results_dir=Path(args.out_dir))}")


if __name__ == "__main__":
    main()
