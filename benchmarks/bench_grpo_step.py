"""One GRPO optimizer step (rollout + score + advantage + update): unirl_core vs TRL ``GRPOTrainer``.

Same run, same tiny random-init model (seed 0), same toy prompts, reward, group size, completion
length, batch, optimizer and loss; result = median step time of ours / median step time of TRL.

Matched settings (TRL ``GRPOConfig`` name = value):
    per_device_train_batch_size = prompts * group (one micro-batch), num_generations = group,
    gradient_accumulation_steps = 1, steps_per_generation = 1, num_iterations = 1,
    max_completion_length = new tokens, temperature = 1.0, top_p = 1.0, top_k = 0,
    loss_type = "grpo", beta = 0.0, epsilon = 0.2, scale_rewards = "group",
    learning_rate = lr, lr_scheduler_type = "constant", optim = "adamw_torch", weight_decay = 0,
    max_grad_norm = 1.0, gradient_checkpointing = False, use_cpu = True, bf16 = False,
    plain-text prompts (no chat template on either side), no logging/saving in the timed steps.
Ours is timed twice: as shipped (the engine rescores finished sequences so the first ratio is
exactly 1, a forward TRL does not run with num_iterations = 1) and with ``logp_source="decode"``
(decode-loop log-probs, ratio 1 to ~1e-6: the same model work as TRL).

    OMP_NUM_THREADS=1 (set below) python benchmarks/bench_grpo_step.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ar_rollout import hardware  # noqa: E402
from common import write_record  # noqa: E402

from unirl_core.algorithms.grpo import GRPO, GRPOConfig  # noqa: E402
from unirl_core.data import PromptDataset, ToyArithmeticConfig, toy_arithmetic_prompts, toy_arithmetic_reward  # noqa: E402
from unirl_core.models.lm import build_tiny_lm  # noqa: E402
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine  # noqa: E402
from unirl_core.types import ARSamplingParams, SampleBatch  # noqa: E402



def ours(args, records, logp_source: str) -> tuple[list[float], list[float], list[float]]:
    """Step times, mean rewards and mean completion lengths of our loop."""
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    n = args.prompts * args.group
    eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=n, apply_chat_template=False,
                                                   logp_source=logp_source))
    alg = GRPO(GRPOConfig(loss_agg="grpo", epsilon=0.2, beta=0.0))
    opt = torch.optim.AdamW(bundle.module.parameters(), lr=args.lr, weight_decay=0.0)
    data = PromptDataset(records, seed=0)
    sp = ARSamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0)
    times, rewards, lengths = [], [], []
    for step in range(args.warmup + args.steps):
        t = time.perf_counter()
        batch = eng.generate(SampleBatch.from_prompts(data.batch(step, args.prompts), samples_per_prompt=args.group,
                                                      kind="ar", sampling=sp))
        for idx in batch.groups().values():
            parts = [batch.samples[i].generated for i in idx]
            r = torch.tensor([toy_arithmetic_reward(p.text, p.targets["answer"]) for p in parts])
            adv = (r - r.mean()) / (r.std() + 1e-4)  # TRL: unbiased group std, eps 1e-4
            for p, rv, a in zip(parts, r.tolist(), adv.tolist()):
                p.reward, p.advantage = rv, a
        bundle.module.train()
        opt.zero_grad(set_to_none=True)
        out = alg.loss(bundle, batch, old_log_probs=None)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(bundle.module.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t)
        rewards.append(sum(s.generated.reward for s in batch) / len(batch))
        lengths.append(out.metrics["response_len_mean"])
    return times[args.warmup:], rewards, lengths[args.warmup:]


def ours_phases(args, logp_source: str = "rescore") -> tuple[list[float], list[float], list[float]]:
    """The path users run: ``run_local`` over the tiny-grpo recipe with matched settings - the same phase
    functions the Flyte tasks call (trainside engine, RewardService, advantages, TrainBackend with the
    trainer's own bundle, checkpoint write + publish of every version). Step time = ``time/step``."""
    from unirl_core.config import load_recipe
    from unirl_core.loop.local import run_local

    n = args.prompts * args.group
    cfg = load_recipe("tiny-grpo", [
        f"checkpoint.root={tempfile.mkdtemp()}", f"loop.total_steps={args.warmup + args.steps}",
        f"data.prompts_per_step={args.prompts}", f"data.samples_per_prompt={args.group}",
        "data.toy.num_prompts=64", f"lm.sampling.max_new_tokens={args.new_tokens}", "lm.sampling.temperature=1.0",
        f"lm.engine.forward_batch_size={n}", "lm.engine.apply_chat_template=false",
        f"lm.engine.logp_source={logp_source}", f"train.micro_batch_size={n}", f"train.lr={args.lr}",
        "train.max_grad_norm=1.0", "advantage.unbiased_std=true", "lm.algorithm.loss_agg=grpo",
        "lm.algorithm.epsilon=0.2", "lm.algorithm.beta=0.0"])
    hist = run_local(cfg)
    times = [h["time/step"] for h in hist]
    return (times[args.warmup:], [h["reward/mean"] for h in hist],
            [h["train/response_len_mean"] for h in hist][args.warmup:])


def trl_run(args, records) -> tuple[list[float], list[float], list[float]]:
    """Step times, mean rewards and mean completion lengths of TRL's GRPOTrainer."""
    import datasets
    import trl
    from transformers import TrainerCallback

    bundle = build_tiny_lm(seed=0, keep_reference=False)
    ds = datasets.Dataset.from_list([{"prompt": r.prompt, "answer": r.targets["answer"]} for r in records])

    def reward(completions, answer, **_):
        return [toy_arithmetic_reward(c, a) for c, a in zip(completions, answer)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.rewards, self.lengths, self._t = [], [], [], 0.0

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])
                self.lengths.append(logs.get("completions/mean_length", float("nan")))

    cfg = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0, loss_type="grpo",
        beta=0.0, epsilon=0.2, scale_rewards="group", learning_rate=args.lr, lr_scheduler_type="constant",
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, gradient_checkpointing=False,
        use_cpu=True, bf16=False, logging_steps=1, report_to="none", save_strategy="no",
        max_steps=args.warmup + args.steps, seed=0, disable_dropout=True, log_completions=False,
        dataloader_num_workers=0)
    timer = Timer()
    trainer = trl.GRPOTrainer(model=bundle.module, reward_funcs=reward, args=cfg, train_dataset=ds,
                              processing_class=bundle.tokenizer, callbacks=[timer])
    trainer.train()
    return timer.times[args.warmup:], timer.rewards, timer.lengths[args.warmup:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rounds", type=int, default=2, help="alternating blocks of ours / TRL")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.getLogger("transformers").setLevel(logging.ERROR)
    records = toy_arithmetic_prompts(ToyArithmeticConfig(num_prompts=64))
    # Alternate blocks of ours / TRL so that load drifts on a shared machine hit both alike.
    t_ours, t_dec, t_trl, l_ours, l_dec, l_trl = [], [], [], [], [], []
    t_ph, l_ph = [], []
    for _ in range(args.rounds):
        t, r_ph, length = ours_phases(args)
        t_ph += t
        l_ph += length
        t, r_ours, length = ours(args, records, "rescore")
        t_ours += t
        l_ours += length
        t, r_dec, length = ours(args, records, "decode")
        t_dec += t
        l_dec += length
        t, r_trl, length = trl_run(args, records)
        t_trl += t
        l_trl += length
    import trl

    rows = []
    for name, t, length, r in (("unirl_core loop (phases, checkpoints)", t_ph, l_ph, r_ph),
                               ("unirl_core engine+loss (no checkpoint)", t_ours, l_ours, r_ours),
                               ("unirl_core engine+loss decode-logp", t_dec, l_dec, r_dec),
                               (f"trl {trl.__version__}", t_trl, l_trl, r_trl)):
        rows.append({"method": name, "median_step_s": statistics.median(t), "min_step_s": min(t),
                     "completion_len_mean": statistics.fmean(length), "reward_first": r[0], "reward_last": r[-1]})
    for r, t in zip(rows, (t_ph, t_ours, t_dec, t_trl)):
        r["median_ratio_vs_trl"] = r["median_step_s"] / rows[-1]["median_step_s"]
        # step i of a round pairs with step i of TRL's block in the same round (run minutes apart at most)
        r["median_pair_ratio_vs_trl"] = statistics.median(a / b for a, b in zip(t, t_trl))
    ratio = rows[0]["median_pair_ratio_vs_trl"]
    min_ratio = rows[0]["min_step_s"] / rows[-1]["min_step_s"]
    report(args, rows, ratio, min_ratio)


def report(args, rows, ratio, min_ratio) -> None:
    hw = hardware()
    vocab = len(build_tiny_lm(seed=0, keep_reference=False).tokenizer)
    setup = (f"tiny preset (Qwen3, 2 layers x 64, vocab {vocab}), {args.prompts} prompts x group {args.group}, "
             f"{args.new_tokens} new tokens, fp32, lr {args.lr}, {args.rounds} alternating rounds of "
             f"{args.steps} timed steps after {args.warmup} warm-up")
    print(setup)
    print(f"{'method':<42}{'median s':>10}{'min s':>9}{'vs TRL':>8}{'pairs':>8}{'len':>7}{'reward first->last':>22}")
    for r in rows:
        print(f"{r['method']:<42}{r['median_step_s']:>10.3f}{r['min_step_s']:>9.3f}{r['median_ratio_vs_trl']:>7.2f}x"
              f"{r['median_pair_ratio_vs_trl']:>7.2f}x{r['completion_len_mean']:>7.1f}{r['reward_first']:>12.3f} -> "
              f"{r['reward_last']:.3f}")
    print(f"step time ratio unirl_core / TRL = {ratio:.2f}x median of pair ratios, {min_ratio:.2f}x min "
          "(target <= 0.5x)")
    md = ["### GRPO optimizer step vs TRL GRPOTrainer (CPU)", "", f"Setup: {setup}.",
          f"Hardware: {hw['cpu']}, {hw['cores']} cores, OMP_NUM_THREADS={hw['omp_num_threads']}; torch {hw['torch']}, "
          f"transformers {hw['transformers']}.", "",
          "| method | median step s | min step s | medians vs TRL | median of pair ratios | mean completion len |",
          "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['method']} | {r['median_step_s']:.3f} | {r['min_step_s']:.3f} | {r['median_ratio_vs_trl']:.2f}x | "
           f"{r['median_pair_ratio_vs_trl']:.2f}x | {r['completion_len_mean']:.1f} |" for r in rows]
    md += ["", "`loop (phases, checkpoints)` is the path users run (`run_local` over the tiny-grpo recipe: the "
           "phase functions the Flyte tasks call, each version checkpointed and published; the ratio headline). "
           "`engine+loss` rows are a hand-written loop over the engine and the loss (no TrainBackend, no "
           "checkpoint) kept for comparison. Rescoring records exact log-probs (first ratio exactly 1); "
           "`decode-logp` keeps the decode loop's log-probs (ratio 1 to ~1e-6), the model work TRL does with "
           "num_iterations=1."]
    md += ["", f"Step time ratio unirl_core / TRL: **{ratio:.2f}x** median of pair ratios, {min_ratio:.2f}x min "
           "(target <= 0.5x)."]
    write_record("grpo_step", {"setup": vars(args), "rows": rows, "ratio_ours_over_trl": ratio,
                               "min_ratio_ours_over_trl": min_ratio}, "\n".join(md), env=hw,
                 headline=f"ours / TRL step time {ratio:.2f}x (median of pair ratios)")


if __name__ == "__main__":
    main()
