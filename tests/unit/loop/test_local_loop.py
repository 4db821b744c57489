"""The phase functions chained in-process on both tiny recipes."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from unirl_core.checkpoint import CheckpointStore
from unirl_core.config import load_recipe
from unirl_core.runtime import build
from unirl_core.loop.local import run_local
from unirl_core.loop.phases import step_prompts


def _weights(root, run, step):
    return safetensors.torch.load_file(f"{root}/{run}/step-{step:08d}/model.safetensors")


@pytest.mark.slow
def test_tiny_flow_grpo_runs_with_exact_first_ratio(tmp_path):
    cfg = load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=2",
                                         "data.samples_per_prompt=4", "diffusion.engine.forward_batch_size=4",
                                         "train.micro_batch_size=4"])
    hist = run_local(cfg)
    assert [h["step"] for h in hist] == [1.0, 2.0]
    for h in hist:  # one update per rollout batch from the rollout weights: exact
        assert h["train/ratio_mean"] == 1.0 and h["train/ratio_min"] == 1.0 and h["train/ratio_max"] == 1.0
        assert h["train/logp_absdiff_max"] == 0.0
    assert CheckpointStore(str(tmp_path), cfg.name).latest().step == 2


@pytest.mark.slow
def test_tiny_grpo_resume_equals_uninterrupted(tmp_path):
    over = ["loop.total_steps=3"]
    a, b = tmp_path / "a", tmp_path / "b"
    full = run_local(load_recipe("tiny-grpo", over + [f"checkpoint.root={a}"]))
    part = run_local(load_recipe("tiny-grpo", ["loop.total_steps=2", f"checkpoint.root={b}"]))
    rest = run_local(load_recipe("tiny-grpo", over + [f"checkpoint.root={b}"]))
    assert [h["step"] for h in part + rest] == [1.0, 2.0, 3.0]
    assert rest[0]["reward/mean"] == full[2]["reward/mean"]
    wa, wb = _weights(a, "tiny-grpo", 3), _weights(b, "tiny-grpo", 3)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert run_local(load_recipe("tiny-grpo", over + [f"checkpoint.root={b}"])) == []  # nothing left to do


@pytest.mark.slow
def test_tiny_grpo_learns_the_toy_task(tmp_path):
    hist = run_local(load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=36"]))
    first = sum(h["reward/mean"] for h in hist[:6]) / 6
    last = sum(h["reward/mean"] for h in hist[-6:]) / 6
    assert last > first + 0.1, (first, last)


@pytest.mark.slow
def test_prompts_per_step_not_dividing_the_prompt_count_runs(tmp_path):
    # The bug report: 4 inline prompts at 3 per step. With plain per-epoch shuffles step 3 (stream positions 6-8,
    # across the boundary at 8) drew "two red circles" twice and its sample ids collided (InvariantError).
    cfg = load_recipe("shapes-count-climb", ["data.prompts_per_step=3", "data.samples_per_prompt=2",
                                             "train.micro_batch_size=6",
                                             f"checkpoint.root={tmp_path}", "loop.total_steps=5", "eval=null",
                                             "report.tensorboard=false"])
    ds = build.dataset(cfg)
    assert [ds.records[ds._order(k // 4)[k % 4]].prompt for k in range(6, 9)] == \
        ["three yellow circles", "two red circles", "two red circles"]
    for step in range(1, 6):
        assert len({r.prompt_id for r in step_prompts(cfg, step)}) == 3
    hist = run_local(cfg, resume_from="never", progress=False)
    assert [h["step"] for h in hist] == [1.0, 2.0, 3.0, 4.0, 5.0]
