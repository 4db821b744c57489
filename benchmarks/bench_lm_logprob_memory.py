"""Peak memory and time of the LM token log-prob replay: full-vocabulary fp32 logits vs the chunked head.

One replay of a GRPO micro-batch (B segments, prompt P, response R tokens) at a Qwen vocabulary
(~151.7k, the offline qwen2.5 tokenizer on the tiny random-init Qwen3 preset, hidden 64), on CPU:

- ``full``: ``replay_log_probs_full`` (the pre-chunking path): ``[B, R + 1, V]`` logits, their fp32
  ``/ T`` copy, ``log_softmax`` ``[B, R, V]`` kept for backward, and ``exp(logp) * logp`` for the entropy;
- ``chunk-N``: ``replay_log_probs`` with ``logprob_chunk_tokens = N`` (head + fp32 logsumexp per chunk,
  checkpointed, so backward recomputes a chunk's logits).

Each variant runs in its own subprocess; peak = ``ru_maxrss`` (the process's RSS high-water mark) minus
the RSS before the first replay (model, tokenizer and inputs loaded), so it is the replay's own peak.
``grad`` = one forward + backward with the entropy (the loss forward), ``no_grad`` = a forward (pi_old,
the engine's rescoring). Time = median of ``--repeats`` runs after one warm-up. The body here is tiny
(2 layers, hidden 64), so the numbers isolate the vocabulary-sized part of the replay; at a real model
size the decoder's activations come on top (``lm.model.gradient_checkpointing`` addresses those).

    OMP_NUM_THREADS=1 python benchmarks/bench_lm_logprob_memory.py [--batch 8 --response 256]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median_time, pin_threads, report  # noqa: E402


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(args) -> None:
    import torch

    from unirl_core.models.lm import build_layout, build_tiny_lm, replay_log_probs, replay_log_probs_full
    from unirl_core.types import TokenSegment

    pin_threads(1)
    bundle = build_tiny_lm(seed=0, tokenizer="qwen2.5", keep_reference=False)
    vocab = bundle.module.config.vocab_size
    g = torch.Generator().manual_seed(0)
    segs = [TokenSegment(prompt_ids=torch.randint(0, vocab, (args.prompt,), generator=g),
                         response_ids=torch.randint(0, vocab, (args.response,), generator=g),
                         log_probs=torch.zeros(args.response), response_mask=torch.ones(args.response, dtype=bool))
            for _ in range(args.batch)]
    layout = build_layout(segs, [1.0] * args.batch, pad_id=bundle.pad_token_id)
    chunk = None if args.variant == "full" else int(args.variant.split("-")[1])

    def replay(grad: bool):
        with bundle.compute(), torch.set_grad_enabled(grad):
            if chunk is None:
                logp, _ = replay_log_probs_full(bundle.module, layout, with_entropy=grad)
            else:
                logp, _ = replay_log_probs(bundle.module, layout, with_entropy=grad, chunk_tokens=chunk)
            if grad:
                logp.sum().backward()
                bundle.module.zero_grad(set_to_none=True)
        return logp.detach()

    before = _rss_mib()
    logp = replay(args.mode == "grad")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    seconds = median_time(lambda: replay(args.mode == "grad"), repeats=args.repeats, warmup=0)
    torch.save(logp, Path(args.out).with_suffix(".pt"))
    Path(args.out).write_text(json.dumps({"vocab": vocab, "rss_before_mib": before, "peak_mib": peak,
                                          "replay_peak_mib": peak - before, "seconds": seconds}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--chunks", default="1024,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant")
    ap.add_argument("--mode")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.variant:
        worker(args)
        return
    import torch

    variants = ["full"] + [f"chunk-{int(c)}" for c in args.chunks.split(",")]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("grad", "no_grad"):
            for v in variants:
                out = Path(tmp) / f"{v}-{mode}.json"
                cmd = [sys.executable, __file__, "--variant", v, "--mode", mode, "--out", str(out),
                       "--batch", str(args.batch), "--prompt", str(args.prompt), "--response", str(args.response),
                       "--repeats", str(args.repeats)]
                subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
                r = json.loads(out.read_text())
                r["logp"] = torch.load(out.with_suffix(".pt"))
                results[f"{v}/{mode}"] = r
        rows, data = [], {}
        for key, r in results.items():
            v, mode = key.split("/")
            ref = results[f"full/{mode}"]
            diff = float((r["logp"] - ref["logp"]).abs().max())
            rows.append([v, mode, f"{r['replay_peak_mib']:.0f}", f"{r['replay_peak_mib'] / ref['replay_peak_mib']:.2f}",
                         f"{r['seconds']:.2f}", f"{r['seconds'] / ref['seconds']:.2f}", f"{diff:.1e}"])
            data[key] = {k: r[k] for k in ("vocab", "rss_before_mib", "peak_mib", "replay_peak_mib", "seconds")}
            data[key]["max_abs_diff_vs_full"] = diff
    vocab = next(iter(results.values()))["vocab"]
    full_logits_mib = args.batch * args.response * vocab * 4 / 2**20
    report("lm_logprob_memory",
           f"LM log-prob replay, B={args.batch} P={args.prompt} R={args.response} V={vocab} (tiny Qwen3 body, CPU fp32)",
           ["variant", "mode", "replay peak MiB", "x full", "seconds", "x full", "max |logp - full|"], rows,
           {"batch": args.batch, "prompt": args.prompt, "response": args.response, "vocab": vocab,
            "one_fp32_BxRxV_mib": full_logits_mib, "variants": data},
           notes=f"One fp32 [B, R, V] copy is {full_logits_mib:.0f} MiB. Peak = process RSS high-water mark minus the "
                 "RSS before the replay (each variant in its own subprocess). grad = forward + backward with "
                 "entropy; no_grad = forward only. The chunked path computes only the valid response tokens.", cell="tiny_cpu")


if __name__ == "__main__":
    main()
