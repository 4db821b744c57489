"""Tool use learnt with GRPO: SFT warm start on the calculator format, then ``tiny-agent-calc``; held-out accuracy
before and after RL.

What it runs (all shipped paths, CPU):

1. The shipped SFT recipe ``sft-agent-calc`` (``examples/agentic``): records for the RL recipe's training prompts
   (2-digit products), a fraction ``tool_frac`` of them calling the calculator (``[a*b]`` -> observation -> the
   product), the rest answering directly (a tiny model cannot multiply, so direct answers are mostly wrong);
   ``unirl_core.sft`` trains the tiny preset on them (environment turns masked) and exports the model.
   Rerunning with the same ``--root`` resumes the finished SFT run (no training) and only redoes RL.
2. ``tiny-agent-calc`` starts from that export (its ``lm.model.model``, pointed at ``--root``); ``eval_phase``
   scores the held-out prompts greedily before RL, ``run_local`` trains, and the last step's eval scores them
   after.

Reported: held-out accuracy (reward = 1 for a correct final answer) and the tool-call rate (trajectories with
more than one model turn) before/after, the train reward per step, the first update's ratio, wall time.

    OMP_NUM_THREADS=1 python benchmarks/agent_calc.py    # writes results/agent_calc/latest.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/agent_calc.py` from anywhere

from benchmarks.common import write_record  # noqa: E402
from unirl_core.config.recipes import load_recipe
from unirl_core.runtime import build
from unirl_core.loop.evaluate import eval_phase
from unirl_core.loop.local import run_local
from unirl_core.loop.phases import init_run
from unirl_core.rollout.agentic import TURNS_KEY
from unirl_core.sft.config import load_sft_recipe
from unirl_core.sft.local import run_sft


DESCRIPTION = ("Calculator-tool agent: the shipped warm start (sft-agent-calc), then GRPO (tiny-agent-calc); "
               "held-out accuracy and tool-call rate before and after RL.")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None  # None: the SFT run was resumed finished (no step trained here)


def tool_rate(batch) -> float:
    parts = batch.generated
    return sum(int((p.conditions[TURNS_KEY][:, 0] == 0).sum()) > 1 for p in parts) / max(len(parts), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rl-steps", type=int, default=40)
    ap.add_argument("--root", default=None, help="checkpoint root (default: a temporary folder)")
    ap.add_argument("--no-record", action="store_true", help="print only, write no record")
    ap.add_argument("--override", action="append", default=[], help="extra RL recipe overrides")
    ap.add_argument("--sft-override", action="append", default=[], help="extra SFT recipe overrides")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.root or tempfile.mkdtemp(prefix="agent-calc-"))
    t0 = time.perf_counter()
    rl_overrides = [f"checkpoint.root={root}", f"loop.total_steps={args.rl_steps}", "report.tensorboard=false",
                    *args.override]
    sft = load_sft_recipe("sft-agent-calc", [f"checkpoint.root={root}", *args.sft_override])
    t_sft = time.perf_counter()
    sft_hist = run_sft(sft, progress=False)
    sft_s = time.perf_counter() - t_sft
    export = root / sft.name / "export"
    cfg = load_recipe("tiny-agent-calc", [*rl_overrides, f"lm.model.model={export}"])
    shutil.rmtree(root / cfg.name, ignore_errors=True)  # the RL run starts from the SFT export every time
    ref0 = init_run(cfg)
    before, before_m = eval_phase(cfg, ref0)
    t_rl = time.perf_counter()
    hist = run_local(cfg, progress=True)
    rl_s = time.perf_counter() - t_rl
    after, after_m = eval_phase(cfg, build.store(cfg).latest())
    result = {
        "benchmark": "agent_calc", "recipe": "tiny-agent-calc", "sft_recipe": "sft-agent-calc",
        "sft_steps": sft.loop.total_steps, "rl_steps": args.rl_steps,
        "tool_frac_sft_data": sft.data.section("calc").tool_frac, "overrides": args.override,
        "sft_overrides": args.sft_override, "sft_lr": sft.train.lr,
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
    if not args.no_record:
        md = (f"| | accuracy | tool-call rate |\n|---|---|---|\n"
              f"| before RL | {result['before']['accuracy']:.3f} | {result['before']['tool_call_rate']:.3f} |\n"
              f"| after RL | {result['after']['accuracy']:.3f} | {result['after']['tool_call_rate']:.3f} |")
        b, a = result["before"], result["after"]
        headline = (f"held-out accuracy {b['accuracy']:.3f} -> {a['accuracy']:.3f}, tool-call rate "
                    f"{b['tool_call_rate']:.2f} -> {a['tool_call_rate']:.2f}")
        print(f"wrote {write_record('agent_calc', result, md, headline=headline, description=DESCRIPTION)}")


if __name__ == "__main__":
    main()
