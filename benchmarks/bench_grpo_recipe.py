"""GRPO step at recipe shapes: the shipped loop (``run_local``) vs TRL ``GRPOTrainer``, same run, CPU or CUDA.

Each side runs in its own subprocess (clean peak-memory accounting, nothing shared), alternating ours / TRL
for ``--rounds`` rounds; a round's step i of ours and step i of TRL form a pair. Reported: median step time
of each side, the median of the per-pair ratios ours / TRL, and peak memory (``torch.cuda.max_memory_allocated``
on CUDA, RSS high-water mark on CPU) over the whole run of each side.

Sides:
- ``loop``: ``run_local`` over the tiny-grpo recipe with the preset's shape: the phase functions the Flyte tasks
  call, a rollout bundle and a trainer bundle, every version checkpointed (weights + optimizer state) and
  published to ``--checkpoint-root`` (a full fine-tune writes ~12 bytes per parameter per step there) by the
  process's background writer thread while the next step runs (``checkpoint/*`` metrics);
- ``backend``: the same engine, reward service, advantages and ``TrainBackend`` without the store: weights go
  trainer -> rollout bundle on the device each step (what the pool does in-pool); shows what the store costs;
  both our sides hold two model copies (the rollout bundle in the model dtype, the trainer's fp32 masters);
- ``trl``: TRL ``GRPOTrainer`` with matched settings: per_device_train_batch_size = micro-batch,
  gradient_accumulation_steps = steps_per_generation = samples / micro-batch (one generation of all samples,
  then the same micro-batches and one optimizer step), num_generations = group, num_iterations = 1,
  temperature 1, top_p 1, top_k 0, beta 0, the preset's loss_type / epsilons, constant lr, TRL's default
  optimizer (``--trl-optim`` to pick one; runs before 2026-12-02 forced ``adamw_torch``), max_grad_norm 1,
  gradient checkpointing as ours, bf16 = the model dtype on CUDA. TRL keeps bf16 weights and
  optimizer state (ours: fp32 master weights + fp32 AdamW state) and does not rescore (ours records exact
  log-probs with one extra no-grad forward so the first ratio is exactly 1).

Models: random init from config (seed 0; no hub). ``tiny`` is the offline tiny preset; the Qwen3 shapes use a
word-level tokenizer over the real 151,936-token vocabulary. Reward (both sides): a deterministic hash of the
completion text in [0, 1] (varied within a group, so advantages and gradients are non-zero).

Presets (``--preset``; every field can be overridden by its flag):
- ``tiny``: tiny preset, fp32, 2 prompts x 4 samples x 8 new tokens, prompt 8: the quick CPU check;
- ``0.6b``: Qwen3-0.6B shape, bf16, 8 prompts x 8 samples x 256 new tokens, prompt 64, micro-batch 8, decode 64;
- ``math``: the qwen3-math recipe's shape: Qwen3-1.7B, bf16, 1 prompt x 16 samples x 1024 new tokens (16 x 1025
  kept positions), prompt 128, micro-batch 16, DAPO loss (eps 0.2 / 0.28), gradient checkpointing;
- ``4b``: Qwen3-4B shape, bf16, 8 x 8 x 256, gradient checkpointing, ``backend`` side only (a full fine-tune
  version is ~48 GB; TRL is left out by default: add ``--sides backend,trl`` to try it).

    OMP_NUM_THREADS=1 python benchmarks/bench_grpo_recipe.py --preset tiny
    python benchmarks/bench_grpo_recipe.py --preset 0.6b --device cuda
    python benchmarks/bench_grpo_recipe.py --preset math --device cuda --checkpoint-root /dev/shm/unirl-bench
    python benchmarks/bench_grpo_recipe.py --preset 4b --device cuda

``--memory-report DIR`` (CUDA) records the caching allocator's history in each side and writes
``DIR/<side>_peak.txt``: the allocations alive at that side's peak, by the code that made them
(``benchmarks/cuda_peak.py``); a diagnostic run, not a timing run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import RESULTS, matmul_peak_tflops, write_record  # noqa: E402
from grpo_shapes import (  # noqa: E402
    SHAPES,
    TextHashScorer,
    build_model,
    model_flops_per_step,
    prompt_texts,
    text_reward,
    tokenizer,
)

PRESETS = {
    "tiny": dict(shape="tiny", dtype="float32", prompts=2, group=4, new_tokens=8, prompt_len=8, micro_batch=4,
                 decode_batch=8, loss="grpo", grad_ckpt=False, lr=1e-3, sides="loop,backend,trl"),
    "0.6b": dict(shape="qwen3-0.6b", dtype="bfloat16", prompts=8, group=8, new_tokens=256, prompt_len=64,
                 micro_batch=8, decode_batch=64, loss="grpo", grad_ckpt=False, lr=1e-6, sides="loop,backend,trl"),
    "math": dict(shape="qwen3-1.7b", dtype="bfloat16", prompts=1, group=16, new_tokens=1024, prompt_len=128,
                 micro_batch=16, decode_batch=16, loss="dapo", grad_ckpt=True, lr=1e-6, sides="loop,backend,trl"),
    "4b": dict(shape="qwen3-4b", dtype="bfloat16", prompts=8, group=8, new_tokens=256, prompt_len=64,
               micro_batch=8, decode_batch=64, loss="grpo", grad_ckpt=True, lr=1e-6, sides="backend"),
}
# ----------------------------------------------------------------------------- ours


def recipe_config(a, texts: list[str], root: str):
    """``--recipe``: the loop side runs the shipped recipe; only what makes it this benchmark is set (the shape's
    random-init model, its dtype and device, the inline prompts and the hash reward, lengths, the micro-batch and
    the run's length and root). Engine, decode, replay chunking, checkpointing, optimizer and sampling knobs stay
    as the recipe ships them. One rollout shard: the benchmark's whole step is what one of the recipe's shards
    holds (64 samples)."""
    from unirl_core.config.loader import from_dict
    from unirl_core.config.recipes import load_recipe_dict
    from unirl_core.config.run import RunConfig

    over = [f"checkpoint.root={root}", "checkpoint.keep_last=1", "checkpoint.keep_every=null",
            f"loop.total_steps={a.warmup + a.steps}", "loop.rollout_shards=1", f"lm.model.dtype={a.dtype}",
            "lm.model.model=tiny",  # the hub id out (no hub here): _prepare_ours builds the shape at random init
            f"lm.model.device={a.device}", f"lm.sampling.max_new_tokens={a.new_tokens}",
            f"lm.engine.forward_batch_size={a.micro_batch}", "lm.engine.apply_chat_template=false",
            f"lm.algorithm.max_response_tokens={a.new_tokens}", f"train.micro_batch_size={a.micro_batch}",
            "report.progress=false", "report.tensorboard=true"]
    data = load_recipe_dict(a.recipe, over)
    data.pop("cluster", None)  # the Flyte pods section (load_recipe drops it too)
    data["name"] = "bench"
    data["data"] = {"source": "inline", "prompts": texts, "prompts_per_step": a.prompts,
                    "samples_per_prompt": a.group}
    data["reward"] = {"components": [{"name": "bench_text_hash", "weight": 1.0}]}
    return from_dict(RunConfig, data, "bench")


def recipe_shape(a) -> None:
    """``--recipe``: what both sides share with the recipe (loss, epsilons, gradient checkpointing, lr)."""
    from unirl_core.config.recipes import load_recipe_dict

    d = load_recipe_dict(a.recipe)
    lm = d.get("lm", {})
    a.loss = lm.get("algorithm", {}).get("loss_agg", a.loss)
    a.grad_ckpt = bool(lm.get("model", {}).get("gradient_checkpointing", a.grad_ckpt))
    a.lr = float(d.get("train", {}).get("lr", a.lr))


def run_config(a, texts: list[str], root: str):
    from unirl_core.config.loader import from_dict
    from unirl_core.config.recipes import load_recipe_dict
    from unirl_core.config.run import RunConfig

    if a.recipe:
        return recipe_config(a, texts, root)
    n = a.prompts * a.group
    over = [f"checkpoint.root={root}", "checkpoint.keep_last=1", f"loop.total_steps={a.warmup + a.steps}",
            f"lm.model.dtype={a.dtype}", f"lm.model.device={a.device}", "lm.model.finetune=full",
            "lm.model.keep_reference=false", f"lm.model.gradient_checkpointing={str(a.grad_ckpt).lower()}",
            f"lm.sampling.max_new_tokens={a.new_tokens}", "lm.sampling.temperature=1.0", "lm.sampling.top_p=1.0",
            "lm.sampling.top_k=0", f"lm.engine.forward_batch_size={a.micro_batch}",
            f"lm.engine.decode_batch_size={a.decode_batch}", "lm.engine.apply_chat_template=false",
            f"lm.algorithm.loss_agg={a.loss}", "lm.algorithm.epsilon=0.2", "lm.algorithm.beta=0.0",
            f"lm.algorithm.epsilon_high={0.28 if a.loss == 'dapo' else 0.2}",
            f"lm.algorithm.max_response_tokens={a.new_tokens}", f"train.micro_batch_size={a.micro_batch}",
            f"train.lr={a.lr}", "train.max_grad_norm=1.0", "advantage.unbiased_std=true", "report.progress=false",
            "report.tensorboard=true"]
    if a.micro_batch_tokens:  # token-budget packing (ours only; TRL's micro-batch is a row count)
        over.append(f"train.micro_batch_tokens={a.micro_batch_tokens}")
    if a.master_weights:  # model: bf16 weights + AdamW state like TRL's (ours only)
        over.append(f"train.master_weights={a.master_weights}")
    if a.optimizer_impl:  # AdamW kernel (default auto: fused on CUDA, foreach on CPU)
        over.append(f"train.optimizer_impl={a.optimizer_impl}")
    if a.rollout_with_trainer:  # the loop samples with the trainer's module: one copy of the weights (ours only)
        over.append("loop.rollout_with_trainer=true")
    if a.cuda_graphs:  # the lean decoder's token step replayed as a CUDA graph (ours only)
        over.append("lm.engine.cuda_graphs=true")
    if a.logprob_chunk:  # response tokens per chunk of the LM head + log-softmax (recording and replay alike)
        over.append(f"lm.model.logprob_chunk_tokens={a.logprob_chunk}")
    if a.full_state_every:  # the loop's versions: weights every step, the full resumable state every n-th
        over.append(f"checkpoint.every_n_steps={a.full_state_every}")
    data = load_recipe_dict("tiny-grpo", over)
    data["data"] = {"source": "inline", "prompts": texts, "prompts_per_step": a.prompts,
                    "samples_per_prompt": a.group}
    data["reward"] = {"components": [{"name": "bench_text_hash", "weight": 1.0}]}
    if n % a.micro_batch:
        raise SystemExit(f"--micro-batch {a.micro_batch} must divide prompts x group = {n}")
    return from_dict(RunConfig, data, "bench")


def _prepare_ours(a):
    """Registers the reward and, for the Qwen3 shapes, makes the loop build the shaped random-init model."""
    from unirl_core.runtime import build
    from unirl_core.models.lm import LMBundle
    from unirl_core.reward import register_scorer

    register_scorer("bench_text_hash", TextHashScorer, replace=True)
    if a.shape != "tiny":
        def fresh_bundle(cfg):
            module, tok = build_model(a)
            return LMBundle(module, tok, config=cfg.lm.model)

        build.fresh_bundle = fresh_bundle


def ours_loop(a, cfg) -> dict:
    from unirl_core.loop.local import run_local

    # wall time between consecutive steps' ends: the step's phases plus what the loop does after them (TensorBoard
    # scalars, the progress line), as a user's run pays it (``time/step`` stops before those)
    ends: list[float] = []
    hist = run_local(cfg, progress=False, on_step=lambda m, b: ends.append(time.perf_counter()))
    gaps = [b - e for e, b in itertools.pairwise(ends)]  # step k's wall is gaps[k - 2] (k >= 2)
    walls = gaps[a.warmup - 1:] if a.warmup >= 1 else [hist[0]["time/step"], *gaps]
    hist = hist[a.warmup:]
    # steps that also wrote the full resumable state (checkpoint.every_n_steps and the run's last step): TRL's
    # side writes nothing, so they are reported apart (and amortized), not mixed into the step median
    full = [cfg.checkpoint.full_state_at(int(h["step"]), cfg.loop.total_steps) for h in hist]
    steady = [h for h, f in zip(hist, full) if not f] or hist
    phases = {k: statistics.median(h[k] for h in steady) for k in steady[0]
              if k.startswith(("time/", "train/time_", "checkpoint/", "rollout/load_weights"))}
    return {"times": walls, "full_state": full, "lengths": [h["train/response_len_mean"] for h in hist],
            "rewards": [h["reward/mean"] for h in hist], "phases": phases,
            "ratio_max_dev": max(max(abs(h["train/ratio_max"] - 1), abs(h["train/ratio_min"] - 1)) for h in hist)}


def ours_backend(a, cfg) -> dict:
    import dataclasses

    import torch

    from unirl_core.advantage.batch import assign_advantages
    from unirl_core.loop import phases
    from unirl_core.runtime import build
    from unirl_core.loop.executors import in_process
    from unirl_core.rollout.ar import TrainsideAREngine
    from unirl_core.types import SampleBatch

    policy, backend = in_process().resources.bundle(cfg), in_process().resources.trainer(cfg)
    trained = dict(backend.policy.module.named_parameters())

    def publish() -> None:  # trainer -> rollout bundle on the device, rounded into its dtype (no host round trip)
        with torch.no_grad():
            for name, p in policy.module.named_parameters():
                if name in trained and trained[name].requires_grad:
                    p.copy_(trained[name])

    publish()
    service = build.reward_service(cfg)
    times, lengths, rewards, dev = [], [], [], 0.0
    peaks: dict[str, float] = {}
    if a.device.startswith("cuda"):  # what is resident before the first step: weights, rollout bundle
        peaks["resident_before_step_1"] = torch.cuda.memory_allocated() / 2**20
        peaks["build"] = torch.cuda.max_memory_allocated() / 2**20
    for step in range(1, a.warmup + a.steps + 1):
        _sync(a.device)
        t0 = time.perf_counter()
        request = SampleBatch.from_prompts(phases.step_prompts(cfg, step), samples_per_prompt=a.group, kind="ar",
                                           sampling=cfg.lm.sampling, policy_version=backend.policy_version)
        engine_cfg = dataclasses.replace(cfg.lm.engine, seed=step, micro_batch_tokens=cfg.train.micro_batch_tokens)
        _phase_peak(a.device, None)
        batch = TrainsideAREngine(policy, engine_cfg, policy_version=backend.policy_version).generate(request)
        _phase_peak(a.device, peaks, "rollout")  # decode + the rescoring forward
        batch, _ = service.score_with_stats(batch)
        batch, _ = assign_advantages(batch, cfg.advantage, None)
        m = backend.step(batch)
        _phase_peak(a.device, peaks, "train")
        publish()
        _sync(a.device)
        times.append(time.perf_counter() - t0)
        lengths.append(m.metrics["response_len_mean"])
        rewards.append(sum(p.reward for p in batch.generated) / len(batch))
        dev = max(dev, abs(m.metrics["ratio_max"] - 1), abs(m.metrics["ratio_min"] - 1))
    if a.device.startswith("cuda"):
        peaks["resident_after_last_step"] = torch.cuda.memory_allocated() / 2**20
    return {"times": times[a.warmup:], "lengths": lengths[a.warmup:], "rewards": rewards, "phases": {},
            "ratio_max_dev": dev, "phase_peak_mib": peaks}


def _phase_peak(device: str, peaks: dict | None, name: str = "") -> None:
    """CUDA: record the peak allocated since the last call under ``name`` (max over steps), then reset it; the
    per-phase split of the backend side's peak memory (``peaks`` None: reset only)."""
    import torch

    if not device.startswith("cuda"):
        return
    _sync(device)
    if peaks is not None:
        peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**20)
    torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------- TRL


def trl_side(a, texts: list[str]) -> dict:
    import datasets
    import trl
    from transformers import TrainerCallback

    model, tok = build_model(a)
    if a.trl_dtype:  # e.g. float32: fp32 weights and AdamW state, bf16 autocast (TRL's fp32-master setup)
        model = model.to(getattr(__import__("torch"), a.trl_dtype))
    ds = datasets.Dataset.from_list([{"prompt": t} for t in texts])

    def reward(completions, **_):
        return [text_reward(c) for c in completions]

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.rewards, self.lengths, self._t = [], [], [], 0.0

        def on_step_begin(self, *args, **kw):
            _sync(a.device)
            self._t = time.perf_counter()

        def on_step_end(self, *args, **kw):
            _sync(a.device)
            self.times.append(time.perf_counter() - self._t)

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])
                self.lengths.append(logs.get("completions/mean_length", float("nan")))

    n = a.prompts * a.group
    cuda = a.device.startswith("cuda")
    cfg = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.micro_batch, num_generations=a.group,
        gradient_accumulation_steps=n // a.micro_batch, steps_per_generation=n // a.micro_batch, num_iterations=1,
        max_completion_length=a.new_tokens, temperature=1.0, top_p=1.0, top_k=0, loss_type=a.loss, beta=0.0,
        epsilon=0.2, epsilon_high=0.28 if a.loss == "dapo" else 0.2, scale_rewards="group", learning_rate=a.lr,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=a.grad_ckpt, use_cpu=not cuda, bf16=cuda and a.dtype == "bfloat16",
        # with --trl-dtype float32 the model holds fp32 weights and bf16=True runs its forwards under autocast
        logging_steps=1, report_to="none", save_strategy="no", max_steps=a.warmup + a.steps, seed=0,
        disable_dropout=True, log_completions=False, dataloader_num_workers=0,
        # default: TrainingArguments' own optimizer (fused AdamW on torch >= 2.8)
        **({"optim": a.trl_optim} if a.trl_optim else {}))
    timer = Timer()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                              callbacks=[timer])
    trainer.train()
    del trainer
    return {"times": timer.times[a.warmup:], "lengths": timer.lengths[a.warmup:], "rewards": timer.rewards,
            "phases": {}, "trl": trl.__version__, "optim": str(getattr(cfg.optim, "value", cfg.optim)),
            "ratio_max_dev": None}


# ----------------------------------------------------------------------------- worker / driver


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_mib(device: str) -> float:
    import resource

    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(a) -> None:
    import logging

    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if a.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        if a.memory_report:
            from benchmarks import cuda_peak

            cuda_peak.start()
    texts = prompt_texts(a, tokenizer(a.shape))
    if a.checkpoint_root:
        os.makedirs(a.checkpoint_root, exist_ok=True)
    root = tempfile.mkdtemp(dir=a.checkpoint_root)
    try:
        if a.worker == "trl":
            out = trl_side(a, texts)
        else:
            _prepare_ours(a)
            cfg = run_config(a, texts, root)
            out = ours_loop(a, cfg) if a.worker == "loop" else ours_backend(a, cfg)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # the backend side resets the peak between its phases (``phase_peak_mib``): the run's peak is their max
    out["peak_mib"] = max([_peak_mib(a.device), *out.get("phase_peak_mib", {}).values()])
    if a.memory_report and a.device.startswith("cuda"):
        from benchmarks import cuda_peak

        os.makedirs(a.memory_report, exist_ok=True)
        cuda_peak.report(Path(a.memory_report) / f"{a.worker}_peak.txt")
    Path(a.out).write_text(json.dumps(out))


def run_side(a, side: str) -> dict:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    argv = [sys.executable, __file__, "--worker", side, "--out", out]
    for k in ("shape", "dtype", "device", "prompts", "group", "new_tokens", "prompt_len", "micro_batch",
              "decode_batch", "micro_batch_tokens", "loss", "lr", "steps", "warmup", "checkpoint_root",
              "master_weights", "full_state_every", "logprob_chunk", "optimizer_impl", "trl_optim",
              "memory_report", "recipe", "trl_dtype"):
        if getattr(a, k) is not None:
            argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if a.grad_ckpt:
        argv.append("--grad-ckpt")
    if a.rollout_with_trainer:
        argv.append("--rollout-with-trainer")
    if a.cuda_graphs:
        argv.append("--cuda-graphs")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout, check=False)
    if proc.returncode != 0:
        tail = proc.stderr[-3000:]
        oom = "out of memory" in tail.lower()
        print(f"[{side}] failed ({'OOM' if oom else f'rc {proc.returncode}'}):\n{tail}", file=sys.stderr)
        return {"failed": "OOM" if oom else f"rc {proc.returncode}", "stderr_tail": tail[-800:]}
    return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=("tiny", *SHAPES))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    for k in ("prompts", "group", "new-tokens", "prompt-len", "micro-batch", "decode-batch"):
        ap.add_argument(f"--{k}", type=int)
    ap.add_argument("--micro-batch-tokens", type=int, default=0,
                    help="ours: train.micro_batch_tokens (token-budget micro-batches); 0 = fixed micro-batch")
    ap.add_argument("--loss", choices=("grpo", "dapo", "dr_grpo"))
    ap.add_argument("--full-state-every", type=int, default=None,
                    help="loop side: checkpoint.every_n_steps (default 1: every version holds the optimizer state)")
    ap.add_argument("--master-weights", choices=("fp32", "model"), default=None,
                    help="ours: train.master_weights (default: the recipe's fp32 masters; model = TRL's footprint)")
    ap.add_argument("--logprob-chunk", type=int, default=None,
                    help="ours: lm.model.logprob_chunk_tokens (default: the config's)")
    ap.add_argument("--rollout-with-trainer", action="store_true", default=None,
                    help="loop side: loop.rollout_with_trainer=true (no rollout bundle: one copy of the weights)")
    ap.add_argument("--cuda-graphs", action="store_true", default=None,
                    help="ours: lm.engine.cuda_graphs=true (the decode step replayed as a CUDA graph)")
    ap.add_argument("--optimizer-impl", choices=("auto", "foreach", "fused"), default=None,
                    help="ours: train.optimizer_impl (default auto: fused AdamW on CUDA, foreach on CPU)")
    ap.add_argument("--trl-optim", default=None,
                    help="TRL: TrainingArguments.optim (default: its own default; transformers 5 on torch >= 2.8: "
                         "adamw_torch_fused; the runs before 2026-12-02 forced adamw_torch)")
    ap.add_argument("--recipe", default=None,
                    help="the loop side runs this shipped recipe (e.g. qwen3-math) with only the benchmark's shape, "
                         "data, reward and run length set; loss, grad ckpt and lr follow it on both sides")
    ap.add_argument("--trl-dtype", default=None, choices=("float32",),
                    help="TRL's weights (and AdamW state) in this dtype, bf16 autocast: fp32 masters like ours")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--grad-ckpt", action="store_true", default=None)
    ap.add_argument("--sides", help="comma list of loop, backend, trl (default: the preset's)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of every side")
    ap.add_argument("--checkpoint-root", default=None, help="where the loop side writes its versions (a tmp dir)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per side and round")
    ap.add_argument("--results", default=str(RESULTS), help="results folder (holds <benchmark>/latest.json)")
    ap.add_argument("--name", default="", help="suffix of the record's cell name (e.g. the shape when not the preset's)")
    ap.add_argument("--memory-report", default=None,
                    help="CUDA: write DIR/<side>_peak.txt, the allocations alive at each side's peak "
                         "(benchmarks/cuda_peak.py; slows allocation, so not a timing run)")
    ap.add_argument("--worker", choices=("loop", "backend", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.recipe:
        recipe_shape(a)
    if a.worker:
        return worker(a)
    a.peak_tflops = matmul_peak_tflops(a.device)
    sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for _ in range(a.rounds):
        for side in sides:
            runs[side].append(run_side(a, side))
            # the JSON so far after every side: a run cut short by a time limit keeps what it measured
            done = [s for s in sides if runs[s]]
            report(a, done, {s: runs[s] for s in done}, final=False)
    report(a, sides, runs)


def summarise(a, side: str, rounds: list[dict], base: list[dict] | None) -> dict:
    ok = [r for r in rounds if "failed" not in r]
    row: dict = {"side": side, "rounds_ok": len(ok), "failed": [r["failed"] for r in rounds if "failed" in r]}
    if not ok:
        return row
    # a step that wrote the full resumable state is not a steady step (unless every step does: every_n_steps 1)
    def steady(r: dict) -> list[bool]:
        flags = r.get("full_state") or [False] * len(r["times"])
        return [True] * len(flags) if all(flags) else [not f for f in flags]

    times = [t for r in ok for t, s in zip(r["times"], steady(r)) if s]
    full_times = [t for r in ok for t, s in zip(r["times"], steady(r)) if not s]
    if full_times:
        row.update(full_state_step_s=statistics.median(full_times), full_state_steps=len(full_times))
    row.update(median_step_s=statistics.median(times), min_step_s=min(times),
               peak_mib=max(r["peak_mib"] for r in ok), completion_len_mean=statistics.fmean(
                   x for r in ok for x in r["lengths"]), phases=ok[-1]["phases"],
               ratio_max_dev=ok[-1].get("ratio_max_dev"))
    if ok[-1].get("phase_peak_mib"):
        row["phase_peak_mib"] = ok[-1]["phase_peak_mib"]
    flops, peak = model_flops_per_step(a), getattr(a, "peak_tflops", None)
    if flops and peak:
        row.update(model_flops_per_step=flops, peak_tflops=peak,
                   mfu=flops / (row["median_step_s"] * peak * 1e12))
    if base is not None:
        pairs = [t / u for r, b in zip(rounds, base) if "failed" not in r and "failed" not in b
                 for t, u, s in zip(r["times"], b["times"], steady(r)) if s]
        if pairs:
            row["median_pair_ratio_vs_trl"] = statistics.median(pairs)
            row["pairs"] = len(pairs)
    return row


def report(a, sides: list[str], runs: dict[str, list[dict]], *, final: bool = True) -> None:
    from bench_ar_rollout import hardware

    base = runs.get("trl")
    rows = [summarise(a, s, runs[s], base if s != "trl" else None) for s in sides]
    if not final:
        _write(a, rows, runs, hardware())
        return
    trl_row = next((r for r in rows if r["side"] == "trl" and "median_step_s" in r), None)
    setup = (f"{a.preset}{f' (recipe {a.recipe} as shipped)' if a.recipe else ''}: {a.shape} ({a.dtype}, random init), {a.prompts} prompts x {a.group} samples x "
             f"{a.new_tokens} new tokens, prompt {a.prompt_len}, micro-batch {a.micro_batch}, decode batch "
             f"{'as the recipe' if a.recipe else a.decode_batch}, micro-batch tokens {a.micro_batch_tokens or '-'}, loss {a.loss}, grad ckpt {a.grad_ckpt}, {a.rounds} rounds x {a.steps} steps after "
             f"{a.warmup} warm-up, device {a.device}")
    print(setup)
    mem = "peak GiB" if a.device.startswith("cuda") else "peak RSS GiB"
    if getattr(a, "peak_tflops", None):
        print(f"MFU: model FLOPs per step {model_flops_per_step(a) / 1e12:.2f} TFLOP (generation + forward/backward) "
              f"over step time x measured bf16 matmul peak {a.peak_tflops:.0f} TFLOP/s")
    print(f"{'side':<10}{'median s':>10}{'min s':>9}{'vs TRL (medians)':>18}{'median pair ratio':>19}{mem:>14}"
          f"{'len':>8}{'MFU':>8}")
    for r in rows:
        if "median_step_s" not in r:
            print(f"{r['side']:<10} failed: {r['failed']}")
            continue
        vs = f"{r['median_step_s'] / trl_row['median_step_s']:.3f}x" if trl_row and r is not trl_row else "-"
        pair = f"{r['median_pair_ratio_vs_trl']:.3f}x" if "median_pair_ratio_vs_trl" in r else "-"
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        print(f"{r['side']:<10}{r['median_step_s']:>10.3f}{r['min_step_s']:>9.3f}{vs:>18}{pair:>19}"
              f"{r['peak_mib'] / 1024:>14.2f}{r['completion_len_mean']:>8.1f}{mfu:>8}")
    loop = next((r for r in rows if r["side"] == "loop" and r.get("phases")), None)
    if loop and "full_state_step_s" in loop:
        every = a.full_state_every
        # a full-state step followed by another step puts its write's wait into that (steady) step; with the full
        # state only on each run's last step nothing shows that wait, so the amortized figure is a lower bound
        mid = any(f for r in runs["loop"] if "full_state" in r for f in r["full_state"][:-1])
        amortized = (f"; amortized over checkpoint.every_n_steps {every}: "
                     f"{loop['median_step_s'] + (loop['full_state_step_s'] - loop['median_step_s']) / every:.3f} s "
                     f"per step{'' if mid else ' (a lower bound: no full-state step mid-run, so the wait of the step after one for its write is not measured)'}"
                     if every else "")
        print(f"loop: {loop['full_state_steps']} step(s) that also wrote the full resumable state (every_n_steps, "
              f"the run's last step) are out of the medians above: median {loop['full_state_step_s']:.3f} s"
              f"{amortized}")
    if loop:
        print("loop phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(loop["phases"].items())))
    print(f"wrote {_write(a, rows, runs, hardware())}")


BENCHMARKS = {"tiny": "grpo_recipe_tiny_cpu", "0.6b": "grpo_recipe_qwen3_0.6b", "math": "grpo_recipe_math",
              "4b": "grpo_recipe_qwen3_4b"}


def _write(a, rows: list[dict], runs: dict[str, list[dict]], hardware: dict) -> Path:
    """The run is a cell of its preset's record, named by the flags that differ from the preset's defaults."""
    tag = f"_master-{a.master_weights}" if a.master_weights else ""
    tag += f"_full-every-{a.full_state_every}" if a.full_state_every else ""
    tag += f"_chunk-{a.logprob_chunk}" if a.logprob_chunk else ""
    tag += "_with-trainer" if a.rollout_with_trainer else ""
    tag += "_graphs" if a.cuda_graphs else ""
    tag += f"_opt-{a.optimizer_impl}" if a.optimizer_impl else ""
    tag += f"_trl-{a.trl_optim}" if a.trl_optim else ""
    tag = (f"_recipe-{a.recipe}" if a.recipe else "") + tag
    tag += f"_trl-{a.trl_dtype}" if a.trl_dtype else ""
    tag += f"_{a.name}" if a.name else ""
    device = a.device.split(":")[0]
    usual = "cpu" if a.preset == "tiny" else "cuda"
    cell = (f"{device}_" if device != usual else "") + (tag.lstrip("_") or "default")
    # Folders of this machine stay out of the record (results dir, checkpoint root): only whether one was given.
    args = {k: (("<set>" if v else v) if k in ("results", "checkpoint_root", "memory_report") else v)
            for k, v in vars(a).items() if k not in ("worker", "out")}
    md = ["| side | median s | min s | median pair ratio vs TRL | peak MiB | MFU |", "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['side']} | {r.get('median_step_s', float('nan')):.3f} | {r.get('min_step_s', float('nan')):.3f} | "
           f"{r.get('median_pair_ratio_vs_trl', float('nan')):.3f} | {r.get('peak_mib', float('nan')):.0f} | "
           f"{format(r['mfu'], '.1%') if 'mfu' in r else '-'} |" for r in rows]
    return write_record(BENCHMARKS[a.preset], {"setup": args, "rows": rows, "runs": runs}, "\n".join(md),
                        cell=cell, env=hardware, results_dir=Path(a.results))

if __name__ == "__main__":
    main()
