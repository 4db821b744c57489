"""GPU peak memory of one LM replay forward + backward at a real size: full-vocabulary logits vs the chunked
head, with and without decoder gradient checkpointing.

A random-init Qwen3 of a given shape (default: Qwen3-1.7B's, vocab 151,936, tied embeddings, bf16, every
weight trainable as in a full fine-tune) replays one micro-batch of B segments (prompt P, response R, all
valid) with entropy, then backward of ``logp.sum()``. Peak = ``torch.cuda.max_memory_allocated`` during the
replay minus the memory allocated before it (weights and inputs); the weight gradients (bf16, one model size)
are part of the peak. No weights are downloaded: the config is built here.

    python benchmarks/gpu_lm_logprob_memory.py [--batch 16 --prompt 128 --response 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unirl_core.models.lm import (build_layout, enable_gradient_checkpointing, replay_log_probs,  # noqa: E402
                                  replay_log_probs_full)
from benchmarks.common import fmt_mfu, lm_replay_flops, matmul_peak_tflops, mfu, write_record  # noqa: E402
from unirl_core.types import TokenSegment  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, head_dim, intermediate, vocab
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936),
}


def build(shape: str, gc: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    h, n, heads, kv, hd, inter, vocab = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=n,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, tie_word_embeddings=True,
                      max_position_embeddings=4096, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    if gc:
        enable_gradient_checkpointing(model)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--cell", default=None, help="cell of results/lm_logprob_memory/latest.json (default: the shape)")
    ap.add_argument("--no-record", action="store_true", help="print only, write no record")
    args = ap.parse_args()
    results = []
    peak_tflops = matmul_peak_tflops("cuda")
    flops = None
    for gc in (False, True):
        model = build(args.shape, gc)
        vocab = model.config.vocab_size
        # model FLOPs: one forward + backward, every weight trained (recomputation not counted)
        flops = lm_replay_flops(model.config, args.batch, args.prompt, args.response, backward="full")
        g = torch.Generator().manual_seed(0)
        segs = [TokenSegment(prompt_ids=torch.randint(0, vocab, (args.prompt,), generator=g),
                             response_ids=torch.randint(0, vocab, (args.response,), generator=g),
                             log_probs=torch.zeros(args.response),
                             response_mask=torch.ones(args.response, dtype=torch.bool)) for _ in range(args.batch)]
        layout = build_layout(segs, [1.0] * args.batch, pad_id=0, device="cuda")
        for variant in ("full", "chunked"):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            row = {"gradient_checkpointing": gc, "variant": variant}
            try:
                t0 = time.perf_counter()
                if variant == "full":
                    logp, ent = replay_log_probs_full(model, layout, with_entropy=True)
                else:
                    logp, ent = replay_log_probs(model, layout, with_entropy=True, chunk_tokens=args.chunk)
                logp.sum().backward()
                torch.cuda.synchronize()
                row["seconds"] = time.perf_counter() - t0
                row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                row["logp_sum"] = float(logp.detach().double().sum())
                row["mfu"] = mfu(flops, row["seconds"], peak_tflops)
            except torch.OutOfMemoryError as e:
                row["error"] = f"OOM: {str(e)[:120]}"
            del logp, ent
            results.append(row)
            print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    summary = {"shape": args.shape, "batch": args.batch, "prompt": args.prompt, "response": args.response,
               "chunk": args.chunk, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "model_flops_per_step": flops, "peak_tflops": peak_tflops, "results": results}
    print(json.dumps(summary, indent=2))
    if not args.no_record:
        md = "| gradient checkpointing | variant | s | peak GiB | MFU |\n|---|---|---|---|---|\n" + "".join(
            f"| {r['gradient_checkpointing']} | {r['variant']} | {r.get('seconds', float('nan')):.3f} | "
            f"{r.get('peak_gib', float('nan')):.2f} | {fmt_mfu(r.get('mfu'))} |\n" if "error" not in r else
            f"| {r['gradient_checkpointing']} | {r['variant']} | {r['error']} | | |\n" for r in results)
        md += ("\nMFU: one forward + backward's model FLOPs (full fine-tune, causal attention, the head on response "
               "positions; recomputation not counted) over the one timed replay (no warm-up) and this GPU's "
               "measured bf16 matmul peak.\n")
        print(f"wrote {write_record('lm_logprob_memory', summary, md, cell=args.cell or args.shape)}")


if __name__ == "__main__":
    main()
