"""The eval phase: held-out prompts, deterministic sampling (ODE / greedy), policy or EMA weights, eval/* metrics in
run_local's step records and the run report's charts."""

import pytest
import torch

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop import phases
from unirl_core.config.eval import EvalConfig
from unirl_core.loop.evaluate import (
    eval_phase,
    eval_prompts,
    resolve_version,
)
from unirl_core.loop.local import run_local
from unirl_core.report.run_report import RunReport

torch.set_num_threads(1)

DIFF = ["data.samples_per_prompt=4", "diffusion.engine.forward_batch_size=4", "train.micro_batch_size=4",
        "diffusion.sampling.height=32", "diffusion.sampling.width=32", "diffusion.sampling.num_steps=4",
        "report.tensorboard=false", 'eval.prompts=["a red fox", "a blue lake"]', "eval.samples_per_prompt=2"]


def test_due_and_config_errors(tmp_path):
    ev = EvalConfig(every_n_steps=3)
    assert [s for s in range(1, 8) if ev.due(s, 7)] == [3, 6, 7]
    assert [s for s in range(1, 8) if EvalConfig(every_n_steps=3, at_end=False).due(s, 7)] == [3, 6]
    assert [s for s in range(1, 5) if EvalConfig().due(s, 4)] == [4]
    assert EvalConfig().due(0, 4) and not EvalConfig(at_start=False).due(0, 4)  # the starting version
    with pytest.raises(ConfigError, match="eval.every_n_steps"):
        EvalConfig(every_n_steps=-1)
    with pytest.raises(ConfigError, match="eval"):
        EvalConfig(at_end=False, at_start=False)
    with pytest.raises(ConfigError, match="eval.prompts"):  # inline prompts cannot draw a held-out set
        load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", "eval.every_n_steps=1"])
    with pytest.raises(ConfigError, match="eval.weights"):
        load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", *DIFF, "eval.weights=ema"])


@pytest.mark.slow
def test_diffusion_eval_every_step_is_deterministic_ode_and_in_the_history(tmp_path):
    cfg = load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=2", *DIFF,
                                         "eval.every_n_steps=1"])
    hist = run_local(cfg, progress=False)
    assert all("eval/reward/mean" in h and h["eval/samples"] == 4.0 and h["time/eval"] > 0 for h in hist)
    assert [h["eval/step"] for h in hist] == [1.0, 2.0]
    ref = resolve_version(cfg, "latest")
    assert ref.step == 2
    a, ma = eval_phase(cfg, ref)
    b, mb = eval_phase(cfg, ref, use_cache=False)  # computed again, not read from the eval cache
    assert ma["eval/reward/mean"] == mb["eval/reward/mean"] == hist[-1]["eval/reward/mean"]  # same bits each time
    assert [s.generated.prompt for s in a] == ["a red fox"] * 2 + ["a blue lake"] * 2
    assert all(not bool(p.segment.sde_mask.any()) for p in a.generated)  # ODE
    assert all(torch.equal(x.segment.latents, y.segment.latents) for x, y in zip(a.generated, b.generated))
    # siblings start from different fixed noise
    assert not torch.equal(a.generated[0].segment.latents[-1], a.generated[1].segment.latents[-1])
    # an older version by path, EMA refused without a decay
    assert resolve_version(cfg, str(tmp_path / cfg.name / "step-00000002")).step == 2
    with pytest.raises(ConfigError, match="ema_decay"):
        eval_phase(cfg, ref, weights="ema")


@pytest.mark.slow
def test_ema_weights_evaluate_differently(tmp_path):
    cfg = load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=2", *DIFF,
                                         "train.ema_decay=0.5", "eval.weights=ema"])
    hist = run_local(cfg, progress=False)
    assert "eval/reward/mean" not in hist[0] and "eval/reward/mean" in hist[1]  # at_end only
    ref = resolve_version(cfg, "latest")
    ema, _ = eval_phase(cfg, ref)
    pol, _ = eval_phase(cfg, ref, weights="policy")
    assert all(p.policy_version == phases.EMA_POLICY_VERSION for p in ema.generated)
    assert not torch.equal(ema.generated[0].segment.latents[-1], pol.generated[0].segment.latents[-1])


def test_lm_eval_is_greedy_on_held_out_prompts(tmp_path):
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=1", "report.tensorboard=false",
                                    "eval.num_prompts=3", "eval.samples_per_prompt=2"])
    train_prompts = {r.prompt for s in range(1, 40) for r in phases.step_prompts(cfg, s)}
    held = eval_prompts(cfg)
    assert len(held) == 3 and all(r.targets for r in held)
    assert not {r.prompt for r in held} & train_prompts
    hist = run_local(cfg, progress=False)
    assert "eval/reward/mean" in hist[0] and hist[0]["eval/response_tokens_mean"] > 0
    batch, _ = eval_phase(cfg, resolve_version(cfg, "latest"), use_cache=False)
    segs = [p.segment for p in batch.generated]
    assert all(torch.equal(segs[2 * i].response_ids, segs[2 * i + 1].response_ids) for i in range(3))  # greedy


def test_run_report_charts_eval_curves(tmp_path):
    report = RunReport(str(tmp_path / "run"))
    for step in (1, 2, 3):
        metrics = {"reward/mean": 0.1 * step}
        if step != 2:
            metrics["eval/reward/mean"] = 0.2 * step
        report.record_step(step, metrics=metrics, batch=None, pages={}, session="s")
    report.render(title="run")
    index = (tmp_path / "run" / "report" / "index.html").read_text()
    assert "<h3>eval</h3>" in index and 'data-metric="eval/reward/mean"' in index



@pytest.mark.slow
def test_start_and_end_eval_go_into_the_report_before_after(tmp_path):
    cfg = load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=2", *DIFF,
                                         "checkpoint.keep_last=3"])
    hist = run_local(cfg, progress=False)
    assert "eval/reward/mean" not in hist[0] and "eval/reward/mean" in hist[1]  # step 0 is not a training step
    evals = RunReport(str(tmp_path / cfg.name)).evals()
    assert [rec.step for rec, _ in evals] == [0, 2]
    start, cells = evals[0]
    assert start.prompts == ["a red fox", "a blue lake"] and set(cells) == set(start.prompts)
    assert all(cells[p].count("<img") == 2 for p in start.prompts)  # eval.samples_per_prompt thumbnails each
    # the recorded "before" is the deterministic eval of the step-0 version, the "after" the last step's
    _, again = eval_phase(cfg, resolve_version(cfg, str(tmp_path / cfg.name / "step-00000000")), use_cache=False)
    assert start.metrics["eval/reward/mean"] == again["eval/reward/mean"]
    assert evals[1][0].metrics["eval/reward/mean"] == hist[1]["eval/reward/mean"]
    means = start.prompt_reward
    assert sum(means) / len(means) == pytest.approx(start.metrics["eval/reward/mean"])  # 2 samples per prompt
    index = (tmp_path / cfg.name / "report" / "index.html").read_text()
    assert "held-out evaluation: step 0 vs step 2" in index and index.count("class='eval-prompt'") == 2
    # no start eval for a run resumed past step 0
    cfg3 = load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=3", *DIFF])
    run_local(cfg3, progress=False)
    assert [rec.step for rec, _ in RunReport(str(tmp_path / cfg.name)).evals()] == [0, 2, 3]
