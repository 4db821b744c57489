"""Train-step overhead: TrainBackend.step vs a hand-written PyTorch loop on the same model and data.

Both run the same GRPO-style token loss over the same micro-batches with the same AdamW, clipping and
schedule; the ratio ``plain_time / backend_time`` is the backend's relative throughput (target >= 0.95).
Steps alternate between the two so machine noise hits both alike. OMP_NUM_THREADS=1 on CPU.

Run: python benchmarks/bench_train.py [--preset tiny|small|1b] [--device cpu|cuda] [--iters N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fmt_mfu, lm_replay_flops, matmul_peak_tflops, mfu_fields, pin_threads, report  # noqa: E402

PRESETS = {
    # hidden, layers, heads, vocab, prompt/response tokens, rollout batch, micro-batch
    "tiny": dict(hidden=64, layers=2, heads=4, vocab=2048, prompt=16, response=48, batch=16, micro=4),
    "small": dict(hidden=256, layers=4, heads=4, vocab=8192, prompt=32, response=96, batch=16, micro=8),
    "1b": dict(hidden=2048, layers=16, heads=16, vocab=32000, prompt=256, response=768, batch=64, micro=8),
}


def build_model(p: dict, device, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=4 * p["hidden"],
                      num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                      num_key_value_heads=p["heads"], max_position_embeddings=p["prompt"] + p["response"],
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).to(device)


class ModelPolicy:
    def __init__(self, model) -> None:
        self._m = model

    @property
    def module(self):
        return self._m

    def reference(self):
        return nullcontext()


class TokenGRPO:
    """Token-level clipped surrogate over fixed-length completions (enough for an overhead benchmark)."""

    def __init__(self, prompt_len: int, device) -> None:
        self.p, self.device = prompt_len, device

    def _collate(self, mb):
        import torch

        segs = [part.segment for part in mb.generated]
        ids = torch.stack([torch.cat([s.prompt_ids, s.response_ids]) for s in segs]).to(self.device)
        old = torch.stack([s.log_probs for s in segs]).to(self.device)
        adv = torch.tensor([part.advantage for part in mb.generated], device=self.device)
        return ids, old, adv

    def token_log_probs(self, model, ids):
        logits = model(input_ids=ids).logits[:, self.p - 1:-1].float()
        return logits.log_softmax(-1).gather(-1, ids[:, self.p:, None]).squeeze(-1)

    def old_log_probs(self, policy, mb):
        ids, _, _ = self._collate(mb)
        return self.token_log_probs(policy.module, ids)

    def loss(self, policy, mb, *, old_log_probs, first_update=False):
        import torch

        from unirl_core.algorithms.base import LossOutput

        ids, stored, adv = self._collate(mb)
        old = stored if old_log_probs is None else old_log_probs
        ratio = torch.exp(self.token_log_probs(policy.module, ids) - old)
        surr = torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
        return LossOutput(loss=-surr.mean(), metrics={})


def make_batch(p: dict, model, algo, seed: int = 0):
    import torch

    from unirl_core.types import ARSamplingParams, Part, Sample, SampleBatch, TokenSegment

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, p["vocab"], (p["batch"], p["prompt"] + p["response"]), generator=g)
    with torch.no_grad():
        lps = torch.cat([algo.token_log_probs(model, ids[i:i + p["micro"]].to(algo.device)).cpu()
                         for i in range(0, p["batch"], p["micro"])])
    samples = []
    for i in range(p["batch"]):
        seg = TokenSegment(prompt_ids=ids[i, :p["prompt"]].clone(), response_ids=ids[i, p["prompt"]:].clone(),
                           log_probs=lps[i].float().clone(), response_mask=torch.ones(p["response"], dtype=torch.bool))
        part = Part(kind="ar", sample_id=f"s{i}", group_id=f"g{i // 4}", segment=seg, sampling=ARSamplingParams(),
                    advantage=float(torch.randn((), generator=g)))
        samples.append(Sample(sample_id=f"s{i}", group_id=f"g{i // 4}", parts=[part]))
    return SampleBatch(samples=samples)


def plain_step(policy, algo, batch, opt, sched, micro: int, autocast, max_norm: float) -> None:
    import torch

    n = len(batch)
    for mb in batch.split(micro):
        with autocast():
            out = algo.loss(policy, mb, old_log_probs=None)
        (out.loss.float() * (len(mb) / n)).backward()
    params = [q for q in policy.module.parameters() if q.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                    help="compute dtype: ours runs the model natively in it over fp32 masters, the plain loop "
                         "uses autocast (default: bf16 on cuda, fp32 on cpu)")
    args = ap.parse_args()
    pin_threads(1)
    import torch

    from unirl_core.train import TrainBackend, TrainConfig, lr_factor

    dev = torch.device(args.device)
    p = PRESETS[args.preset]
    precision = args.precision or ("bf16" if dev.type == "cuda" else "fp32")
    cfg = TrainConfig(lr=1e-5, micro_batch_size=p["micro"], warmup_steps=10, schedule="cosine", total_steps=10_000,
                      max_grad_norm=1.0)
    model = build_model(p, dev)
    # model FLOPs: one forward + backward of every sequence, every weight trained (the head on response positions)
    flops = lm_replay_flops(model.config, p["batch"], p["prompt"], p["response"], backward="full")
    peak = matmul_peak_tflops(args.device)
    algo = TokenGRPO(p["prompt"], dev)
    batch = make_batch(p, model, algo)

    plain_policy = ModelPolicy(copy.deepcopy(model))
    params = [q for q in plain_policy.module.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                            foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    dtype = {"bf16": torch.bfloat16, "fp32": None}[precision]
    autocast = (lambda: torch.autocast(dev.type, dtype=dtype)) if dtype else nullcontext
    # both get a copy (same memory layout); ours holds the model in the compute dtype, the backend keeps fp32
    # masters of the trainable weights and runs the forward natively in that dtype (what a rollout runs)
    backend = TrainBackend(ModelPolicy(copy.deepcopy(model).to(dtype or torch.float32)), algo, cfg)
    del model  # the 1b preset keeps two fp32 copies + AdamW state; drop the third
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    def timed(fn) -> tuple[float, float]:
        # wall time, and this process's CPU time: on a shared CPU box the latter is immune to other jobs
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0

    plain_t, backend_t = [], []
    run_plain = lambda: plain_step(plain_policy, algo, batch, opt, sched, p["micro"], autocast, 1.0)  # noqa: E731
    run_backend = lambda: backend.step(batch)  # noqa: E731
    for _ in range(2):  # warm-up (allocator, kernels)
        run_plain()
        run_backend()
    for i in range(args.iters):
        order = (run_plain, run_backend) if i % 2 == 0 else (run_backend, run_plain)
        for fn in order:
            (plain_t if fn is run_plain else backend_t).append(timed(fn))
    tp, tb = (statistics.median(t[0] for t in ts) for ts in (plain_t, backend_t))
    cp, cb = (statistics.median(t[1] for t in ts) for ts in (plain_t, backend_t))
    n_params = sum(q.numel() for q in plain_policy.module.parameters())
    tokens = p["batch"] * (p["prompt"] + p["response"])
    m_plain, m_backend = mfu_fields(flops, tp, peak), mfu_fields(flops, tb, peak)
    rows = [["plain PyTorch loop", f"{tp * 1e3:.1f}", f"{cp * 1e3:.1f}", f"{tokens / tp:,.0f}", "1.00", "1.00",
             fmt_mfu(m_plain["mfu"])],
            ["TrainBackend.step", f"{tb * 1e3:.1f}", f"{cb * 1e3:.1f}", f"{tokens / tb:,.0f}", f"{tp / tb:.3f}",
             f"{cp / cb:.3f}", fmt_mfu(m_backend["mfu"])]]
    cell = f"{args.preset}_{dev.type}" + ("" if args.precision is None else f"_{precision}")
    data = {"preset": args.preset, "device": str(dev), "precision": precision, "params": n_params, **p,
            "iters": args.iters, "plain_median_s": tp, "backend_median_s": tb, "throughput_ratio": tp / tb,
            "plain_cpu_median_s": cp, "backend_cpu_median_s": cb, "cpu_time_ratio": cp / cb,
            "plain_all_s": plain_t, "backend_all_s": backend_t, **m_backend, "plain_mfu": m_plain["mfu"]}
    report("train", f"Train step overhead ({args.preset}, {n_params / 1e6:.1f}M params, {dev.type}, {precision})",
           ["loop", "wall ms (median)", "CPU ms (median)", "tokens/s", "wall ratio", "CPU-time ratio", "MFU"], rows, data,
           notes=f"Same model/data/optimizer; {args.iters} alternating steps each, medians; rollout batch "
                 f"{p['batch']} x {p['prompt'] + p['response']} tokens, micro-batch {p['micro']}. "
                 "Ratios are plain/backend (>1 = backend faster); target >= 0.95. OMP_NUM_THREADS=1; on a "
                 "shared CPU box the CPU-time ratio is the less noisy one. MFU: one forward + backward of the batch "
                 "(full fine-tune, the head on response positions, causal attention) over the median wall time and "
                 "this GPU's measured bf16 matmul peak (`-` on a CPU).", cell=cell)


if __name__ == "__main__":
    main()
