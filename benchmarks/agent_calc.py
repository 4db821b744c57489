"""Tool use learnt with GRPO: SFT warm start on the calculator format, then ``tiny-agent-calc``; held-out accuracy
before and after RL.

What it runs (all shipped paths, CPU):

1. SFT records for the recipe's training prompts (2-digit products): a fraction ``--tool-frac`` of them call the
   calculator (``[a*b]`` -> observation -> the product), the rest answer directly with the product (a tiny model
   cannot multiply, so direct answers are mostly wrong). ``unirl_core.sft`` trains the tiny preset on them
   (multi-turn records: environment turns masked) and exports the model.
   Rerunning with the same ``--root`` resumes the finished SFT run (no training) and only redoes RL.
2. ``tiny-agent-calc`` starts from that export (``lm.model.model``); ``eval_phase`` scores the held-out prompts
   greedily before RL, ``run_local`` trains, and the last step's eval scores them after.

Reported: held-out accuracy (reward = 1 for a correct final answer) and the tool-call rate (trajectories with
more than one model turn) before/after, the train reward per step, the first update's ratio, wall time.

    OMP_NUM_THREADS=1 python benchmarks/agent_calc.py --out benchmarks/results/agent_calc.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from unirl_core.config.recipes import load_recipe
from unirl_core.data.toy import toy_arithmetic_prompts
from unirl_core.runtime import build
from unirl_core.loop.evaluate import eval_phase
from unirl_core.loop.local import run_local
from unirl_core.loop.phases import init_run
from unirl_core.rollout.agentic import TURNS_KEY
from unirl_core.sft.config import load_sft_recipe
from unirl_core.sft.local import run_sft


def sft_rows(cfg, tool_frac: float, seed: int) -> list[dict]:
    """One conversation per training prompt of the RL recipe's data set (the env's first message = the prompt)."""
    env = cfg.lm.agent.env
    rng = random.Random(seed)
    rows = []
    for rec in toy_arithmetic_prompts(cfg.data.section("toy")):
        expr = rec.prompt.rstrip(" =").replace(" ", "")
        answer = rec.targets["answer"]
        if rng.random() < tool_frac:
            turns = [{"role": "assistant", "content": f"{env.open_tag}{expr}{env.close_tag}"},
                     {"role": "env", "content": answer}, {"role": "assistant", "content": answer}]
        else:
            turns = [{"role": "assistant", "content": answer}]
        rows.append({"prompt": f"{env.instructions}{rec.prompt}", "turns": turns})
    return rows


def _model_overrides(cfg) -> list[str]:
    """The RL recipe's tiny-model shape and seed, so the SFT run trains the same architecture."""
    m = cfg.lm.model
    return [f"lm.model.seed={m.seed}", *(f"lm.model.tiny.{k}={v}" for k, v in vars(m.tiny).items())]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None  # None: the SFT run was resumed finished (no step trained here)


def tool_rate(batch) -> float:
    parts = batch.generated
    return sum(int((p.conditions[TURNS_KEY][:, 0] == 0).sum()) > 1 for p in parts) / max(len(parts), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-steps", type=int, default=1500)
    ap.add_argument("--sft-lr", type=float, default=2e-3)
    ap.add_argument("--rl-steps", type=int, default=40)
    ap.add_argument("--tool-frac", type=float, default=0.3)
    ap.add_argument("--root", default=None, help="checkpoint root (default: a temporary folder)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--override", action="append", default=[], help="extra RL recipe overrides")
    ap.add_argument("--sft-override", action="append", default=[], help="extra SFT recipe overrides")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.root or tempfile.mkdtemp(prefix="agent-calc-"))
    t0 = time.perf_counter()
    rl_overrides = [f"checkpoint.root={root}", f"loop.total_steps={args.rl_steps}", "report.tensorboard=false",
                    *args.override]
    cfg = load_recipe("tiny-agent-calc", rl_overrides)
    data = root / "agent-calc-sft.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_rows(cfg, args.tool_frac, seed=0)))
    sft = load_sft_recipe("sft-tiny-lm", [f"data.path={data}", f"checkpoint.root={root}", "name=agent-calc-sft",
                                          f"loop.total_steps={args.sft_steps}", "loop.steps_per_chunk=500",
                                          f"train.lr={args.sft_lr}",
                                          "data.batch_size=16", "lm.max_completion_tokens=48",
                                          *_model_overrides(cfg), *args.sft_override])
    t_sft = time.perf_counter()
    sft_hist = run_sft(sft, progress=False)
    sft_s = time.perf_counter() - t_sft
    export = root / "agent-calc-sft" / "export"
    cfg = load_recipe("tiny-agent-calc", [*rl_overrides, f"lm.model.model={export}"])
    shutil.rmtree(root / cfg.name, ignore_errors=True)  # the RL run starts from the SFT export every time
    ref0 = init_run(cfg)
    before, before_m = eval_phase(cfg, ref0)
    t_rl = time.perf_counter()
    hist = run_local(cfg, progress=True)
    rl_s = time.perf_counter() - t_rl
    after, after_m = eval_phase(cfg, build.store(cfg).latest())
    result = {
        "benchmark": "agent_calc", "recipe": "tiny-agent-calc", "sft_steps": args.sft_steps, "rl_steps": args.rl_steps,
        "tool_frac_sft_data": args.tool_frac, "overrides": args.override, "sft_overrides": args.sft_override,
        "sft_lr": args.sft_lr,
        "sft_loss_first10": _mean([h["sft/loss"] for h in sft_hist[:10]]),
        "sft_loss_last10": _mean([h["sft/loss"] for h in sft_hist[-10:]]),
        "eval_prompts": len(before),
        "before": {"accuracy": before_m["eval/reward/mean"], "tool_call_rate": tool_rate(before)},
        "after": {"accuracy": after_m["eval/reward/mean"], "tool_call_rate": tool_rate(after)},
        "train_reward_per_step": [round(h["reward/mean"], 4) for h in hist],
        "train_tool_turns_mean_per_step": [round(h["rollout/agent/model_turns_mean"], 3) for h in hist],
        "first_update_ratio": {k: hist[0][f"train/ratio_{k}"] for k in ("min", "max")},
        "seconds": {"sft": sft_s, "rl": rl_s, "total": time.perf_counter() - t0},
        "hardware": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    print(json.dumps({k: result[k] for k in ("before", "after", "first_update_ratio", "seconds")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
