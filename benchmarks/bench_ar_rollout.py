"""Rollout throughput: the trainside AR engine vs plain ``model.generate`` on the same model, same run.

Both sample B prompts x N new tokens at temperature 1 with top-k/top-p off and EOS ignored, so
both produce exactly B x N tokens; the ratio engine_tok_s / generate_tok_s is the result. The
engine is timed twice: with its default exact-replay rescoring forward (``rescore``: what
training uses) and without it (``decode``), and with ``engine.cuda_graphs`` (``rescore_graphs``: the lean
decoder's token step at fixed shapes, replayed as one CUDA graph per token on a GPU; run eagerly on a CPU,
where it only shows the cost of attending over the whole cache). Timings are medians over ``--repeats`` alternating runs
after one warm-up run of each.

CPU (OMP_NUM_THREADS=1 is set below, before torch loads):
    python benchmarks/bench_ar_rollout.py --preset tiny
GPU (e.g. one H200), a random-init Qwen3-0.6B-shaped model:
    python benchmarks/bench_ar_rollout.py --preset qwen3-0.6b --device cuda --dtype bfloat16 --batch 64 --new-tokens 256
Depends on torch + transformers (+ this repository); no hub access, no extra wheels.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt_mfu, lm_generate_flops, matmul_peak_tflops, mfu_fields, write_record  # noqa: E402
from unirl_core.models.lm import LMBundle, LMConfig, build_tiny_lm  # noqa: E402
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine  # noqa: E402
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch  # noqa: E402

# Qwen3-0.6B's published shape (config.json of Qwen/Qwen3-0.6B), random init.
QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def hardware() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__, "python": platform.python_version()}
    import transformers

    info["transformers"] = transformers.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _word_tokenizer(vocab: int, eos: int, pad: int):
    """A word-level tokenizer over ``<i>`` symbols: lets a 151k-vocab random model run without hub files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"<{eos}>", pad_token=f"<{pad}>",
                                   padding_side="left")


# Qwen3-1.7B's published shape (the qwen3-math recipe's model), random init.
QWEN3_17B = dict(QWEN3_06B, hidden_size=2048, intermediate_size=6144)
SHAPES = {"qwen3-0.6b": QWEN3_06B, "qwen3-1.7b": QWEN3_17B}


def build_bundle(preset: str, dtype: torch.dtype, device: str, finetune: str = "full", **config) -> LMBundle:
    """``config``: further LMConfig fields (e.g. gradient_checkpointing) for the shaped presets."""
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    if preset == "tiny":
        bundle = build_tiny_lm(seed=0, keep_reference=False, finetune=finetune, dtype=name)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**SHAPES[preset], pad_token_id=151_643, eos_token_id=151_645, bos_token_id=151_643)
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
        # in its dtype before the bundle sees it: the bundle's compute dtype is the model's dtype
        bundle = LMBundle(model.to(dtype).eval(), _word_tokenizer(cfg.vocab_size, 151_645, 151_643),
                          config=LMConfig(model=preset, keep_reference=False, finetune=finetune,
                                          dtype=name, **config))
    bundle.module.to(device=device, dtype=dtype)
    return bundle


def prompts(bundle: LMBundle, batch: int, prompt_len: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    vocab = len(bundle.tokenizer)
    special = set(bundle.tokenizer.all_special_ids)
    out = []
    for _ in range(batch):
        ids = [i for i in torch.randint(0, vocab, (prompt_len * 2,), generator=g).tolist() if i not in special]
        out.append(bundle.tokenizer.decode(ids[:prompt_len]))
    return out


def time_generate(bundle, texts, new_tokens, device) -> tuple[float, int]:
    tok, model = bundle.tokenizer, bundle.module
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # force N tokens per row, like the engine's ignore_eos
    try:
        _sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
        _sync(device)
        dt = time.perf_counter() - t
    finally:
        model.generation_config.eos_token_id = eos
    return dt, int((out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0])


def time_engine(bundle, texts, new_tokens, device, logp_source, fbs, graphs=False) -> tuple[float, int]:
    eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=fbs, apply_chat_template=False,
                                                   logp_source=logp_source, ignore_eos=True, cuda_graphs=graphs))
    recs = [PromptRecord(prompt_id=str(i), prompt=t) for i, t in enumerate(texts)]
    batch = SampleBatch.from_prompts(recs, samples_per_prompt=1, kind="ar",
                                     sampling=ARSamplingParams(max_new_tokens=new_tokens, temperature=1.0))
    _sync(device)
    t = time.perf_counter()
    out = eng.generate(batch)
    _sync(device)
    return time.perf_counter() - t, sum(s.generated.segment.num_response_tokens for s in out)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=["tiny", "qwen3-0.6b"], default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default=None, help="cell of results/ar_rollout/latest.json (default <preset>_<device>)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dtype = getattr(torch, args.dtype)
    bundle = build_bundle(args.preset, dtype, args.device)
    texts = prompts(bundle, args.batch, args.prompt_len)
    runners = {
        "hf_generate": lambda: time_generate(bundle, texts, args.new_tokens, args.device),
        "engine_rescore": lambda: time_engine(bundle, texts, args.new_tokens, args.device, "rescore", args.batch),
        "engine_decode_only": lambda: time_engine(bundle, texts, args.new_tokens, args.device, "decode", args.batch),
        # the lean decoder's token step at fixed shapes, replayed as a CUDA graph on a GPU (eager on a CPU)
        "engine_rescore_graphs": lambda: time_engine(bundle, texts, args.new_tokens, args.device, "rescore",
                                                     args.batch, graphs=True),
    }
    peak = matmul_peak_tflops(args.device)
    # model FLOPs: the generation every method runs (prefill + KV-cached decode); the rescoring forward is not counted
    lens = [len(ids) for ids in bundle.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    flops = lm_generate_flops(bundle.module.config, args.batch, statistics.fmean(lens), args.new_tokens)
    for run in runners.values():  # warm-up (allocator, kernels, lazy imports)
        run()
    times: dict[str, list[float]] = {k: [] for k in runners}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, run in runners.items():
            dt, n = run()
            times[name].append(dt)
            tokens[name] = n
    rows = []
    base = tokens["hf_generate"] / statistics.median(times["hf_generate"])
    for name in runners:
        tps = tokens[name] / statistics.median(times[name])
        rows.append({"method": name, "tokens": tokens[name], "median_s": statistics.median(times[name]),
                     "tok_per_s": tps, "ratio_vs_hf_generate": tps / base,
                     **mfu_fields(flops, statistics.median(times[name]), peak)})
    report(args, rows)


def report(args, rows) -> None:
    hw = hardware()
    cell = args.name or f"{args.preset}_{args.device.split(':')[0]}"
    setup = (f"preset={args.preset} device={args.device} dtype={args.dtype} batch={args.batch} "
             f"prompt_len={args.prompt_len} new_tokens={args.new_tokens} repeats={args.repeats} (median)")
    print(setup)
    print(f"{'method':<20}{'tokens':>8}{'median s':>11}{'tok/s':>11}{'vs generate':>13}{'MFU':>8}")
    for r in rows:
        print(f"{r['method']:<20}{r['tokens']:>8}{r['median_s']:>11.3f}{r['tok_per_s']:>11.1f}"
              f"{r['ratio_vs_hf_generate']:>12.2f}x{fmt_mfu(r.get('mfu')):>8}")
    md = [f"### AR rollout throughput ({args.preset}, {args.device})", "", f"Setup: {setup}.",
          f"Hardware: {hw.get('gpu', hw['cpu'])}, {hw['cores']} cores, OMP_NUM_THREADS={hw['omp_num_threads']}; "
          f"torch {hw['torch']}, transformers {hw['transformers']}.", "", *md_table(rows), "",
          "MFU: the generation's model FLOPs (prefill + one KV-cached decode step per token; the rescoring forward "
          "not counted) over the median time and this GPU's measured bf16 matmul peak (`-` on a CPU)."]
    write_record("ar_rollout", {"setup": vars(args), "rows": rows}, "\n".join(md), cell=cell, env=hw)


def md_table(rows) -> list[str]:
    """The record's table: one line per method, MFU last."""
    out = ["| method | tokens | median s | tok/s | vs model.generate | MFU |", "|---|---:|---:|---:|---:|---:|"]
    return out + [f"| {r['method']} | {r['tokens']} | {r['median_s']:.3f} | {r['tok_per_s']:.1f} | "
                  f"{r['ratio_vs_hf_generate']:.2f}x | {fmt_mfu(r.get('mfu'))} |" for r in rows]


if __name__ == "__main__":
    main()
