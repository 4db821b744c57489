"""Re-score: a finished run's stored samples scored with other rewards, without training - the run's own scorer
reproduces the stored rewards exactly, other scorers give their own per-step means and correlations, and a run
without stored batches says which setting keeps them."""

from __future__ import annotations

import csv
import math

import pytest

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local
from unirl_core.runs.replay import ReplayInputMissing
from unirl_core.runs.rescore import alternative, parse_reward_arg, pearson, rescore

SMALL = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=4",
         "diffusion.engine.forward_batch_size=4", "diffusion.sampling.num_steps=4", "loop.total_steps=3"]
LM = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
      "lm.engine.forward_batch_size=8", "loop.total_steps=3"]


def test_parse_reward_arg_forms():
    assert parse_reward_arg("aesthetic").name == "aesthetic"
    alt = parse_reward_arg('short=length_penalty:{"max_length": 4, "cache": 2}')
    assert alt.name == "short" and alt.reward.components[0].name == "length_penalty"
    assert alt.reward.components[0].kwargs == {"max_length": 4, "cache": 2}
    assert alt.reward.failure_policy == "mark_invalid"
    with pytest.raises(ConfigError, match="not JSON"):
        parse_reward_arg("x:{oops")
    with pytest.raises(ConfigError, match="a scorer name"):
        parse_reward_arg("name=")


def test_pearson_against_hand_computed_values():
    assert pearson([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]) == pytest.approx(1.0)
    assert pearson([1.0, 2.0, 3.0], [3.0, 1.0, 2.0]) == pytest.approx(-0.5)  # sxy=-1, sxx=syy=2
    assert math.isnan(pearson([1.0, 1.0], [0.0, 1.0])) and math.isnan(pearson([1.0], [1.0]))


@pytest.mark.slow
def test_rescore_diffusion_run(tmp_path):
    cfg = load_recipe("tiny-flow-grpo", [*SMALL, f"checkpoint.root={tmp_path}", "checkpoint.keep_batches=true"])
    history = run_local(cfg, progress=False)
    run = f"{tmp_path}/{cfg.name}"
    table = rescore(run, [alternative("jpeg_compressibility", name="same"), alternative("jpeg_incompressibility")])
    assert [r.step for r in table.rows] == [1, 2, 3]
    for row, metrics in zip(table.rows, history, strict=True):
        assert row.samples == 8
        assert row.means["same"] == row.run == pytest.approx(metrics["reward/mean"], abs=1e-12)
        assert row.correlations["same"] == pytest.approx(1.0)
        assert row.correlations["jpeg_incompressibility"] < -0.9  # the same JPEG size, the other sign
        assert row.means["jpeg_incompressibility"] > 0 > row.run
    with open(tmp_path / cfg.name / "rescore" / "rescore.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "samples", "run", "same", "jpeg_incompressibility", "corr(run,same)",
                       "corr(run,jpeg_incompressibility)"] and len(rows) == 4
    page = (tmp_path / cfg.name / "rescore" / "rescore.html").read_text()
    assert page.count("<svg") == 4  # run, two alternatives, correlations
    only = rescore(run, [alternative("jpeg_incompressibility")], steps=[2], write=False)
    assert [r.step for r in only.rows] == [2]
    assert only.rows[0].means["jpeg_incompressibility"] == table.rows[1].means["jpeg_incompressibility"]


@pytest.mark.slow
def test_rescore_lm_run_and_what_a_run_without_batches_says(tmp_path):
    cfg = load_recipe("tiny-grpo", [*LM, f"checkpoint.root={tmp_path}", "checkpoint.keep_batches=true"])
    history = run_local(cfg, progress=False)
    table = rescore(f"{tmp_path}/{cfg.name}", [alternative("toy_arithmetic"),
                                                parse_reward_arg('short=length_penalty:{"max_length": 4, "cache": 2}')])
    for row, metrics in zip(table.rows, history, strict=True):
        assert row.means["toy_arithmetic"] == row.run == pytest.approx(metrics["reward/mean"], abs=1e-12)
        assert math.isfinite(row.means["short"]) and row.invalid["short"] == 0
    bare = load_recipe("tiny-grpo", [*LM, f"checkpoint.root={tmp_path}", "name=bare", "loop.total_steps=1"])
    run_local(bare, progress=False)
    with pytest.raises(ReplayInputMissing, match="checkpoint.keep_batches=true"):
        rescore(f"{tmp_path}/bare", [alternative("toy_arithmetic")])
    with pytest.raises(ReplayInputMissing, match=r"steps \[7\]"):
        rescore(f"{tmp_path}/{cfg.name}", [alternative("toy_arithmetic")], steps=[7])
