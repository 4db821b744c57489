"""Trainside AR rollout: decoding in the rescoring slices vs one wide decode batch (``lm.engine.decode_batch_size``).

Same engine, same rows and tokens; both sides record log-probs by rescoring in ``forward_batch_size`` slices
(exact for a trainer at that micro-batch), only the KV-cached decode loop's batch width differs. Alternating
runs; reports each side's median and the median of pair ratios (wide / sliced).

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_width.py                       # tiny preset, CPU
    python benchmarks/bench_decode_width.py --preset qwen3-0.6b --device cuda --new-tokens 256
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ar_rollout import build_bundle, hardware, prompts  # noqa: E402
from common import fmt_mfu, lm_generate_flops, matmul_peak_tflops, mfu, write_record  # noqa: E402

from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine  # noqa: E402
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=("tiny", "qwen3-0.6b", "qwen3-1.7b"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--slice", type=int, default=8, help="forward_batch_size: the rescoring (and sliced decode) rows")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dtype = torch.float32 if a.preset == "tiny" else torch.bfloat16
    bundle = build_bundle(a.preset, dtype, a.device)
    n = a.prompts * a.group
    texts = prompts(bundle, a.prompts, a.prompt_len)
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=t) for i, t in enumerate(texts)]
    # model FLOPs: the generation (prefill + KV-cached decode) of every row; the rescoring forward is not counted
    lens = [len(ids) for ids in bundle.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    flops = lm_generate_flops(bundle.module.config, n, statistics.fmean(lens), a.new_tokens)
    peak = matmul_peak_tflops(a.device)
    request = SampleBatch.from_prompts(recs, samples_per_prompt=a.group, kind="ar",
                                       sampling=ARSamplingParams(max_new_tokens=a.new_tokens, temperature=1.0, seed=0))
    engines = {name: TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=a.slice, decode_batch_size=width,
                                                              apply_chat_template=False, ignore_eos=True))
               for name, width in (("sliced", None), ("wide", n))}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(a.repeats + 1):  # the first round warms up
        for name, eng in engines.items():
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            eng.generate(request)
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
    sliced, wide = times["sliced"][1:], times["wide"][1:]
    pair = statistics.median(w / s for w, s in zip(wide, sliced))
    row = {"sliced_median_s": statistics.median(sliced), "wide_median_s": statistics.median(wide),
           "median_pair_ratio_wide_over_sliced": pair, "model_flops_per_step": flops, "peak_tflops": peak}
    row["sliced_mfu"], row["wide_mfu"] = mfu(flops, row["sliced_median_s"], peak), mfu(flops, row["wide_median_s"], peak)
    row["mfu"] = row["wide_mfu"]
    print(f"{a.preset} on {a.device}: {n} rows x {a.new_tokens} new tokens, prompt {a.prompt_len}, rescoring in "
          f"slices of {a.slice}")
    print(f"decode in slices of {a.slice}: {row['sliced_median_s']:.3f} s | one batch of {n}: "
          f"{row['wide_median_s']:.3f} s | median pair ratio {pair:.2f}x | MFU sliced {fmt_mfu(row['sliced_mfu'])}, "
          f"wide {fmt_mfu(row['wide_mfu'])}")
    md = (f"| decode in slices of {a.slice} s | one batch of {n} s | median pair ratio wide / sliced | MFU sliced | "
          f"MFU wide |\n|---|---|---|---|---|\n| {row['sliced_median_s']:.3f} | {row['wide_median_s']:.3f} | {pair:.2f}x | "
          f"{fmt_mfu(row['sliced_mfu'])} | {fmt_mfu(row['wide_mfu'])} |\n\nMFU: the generation's model FLOPs (prefill + "
          f"one KV-cached decode step per token, rescoring not counted) over the median time and this GPU's measured "
          f"bf16 matmul peak (`-` on a CPU).")
    out = write_record("decode_width", {"setup": vars(a), "times": times, **row}, md,
                       cell=f"{a.preset}_{a.device.split(':')[0]}", env=hardware())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
