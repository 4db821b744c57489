"""Run directory + HTML run report (library side) and the phase pages."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch

from tasks.report import progress
from unirl_core.report.charts import histogram_svg
from unirl_core.report.phase_html import advantage_html, publish_html, reward_html
from unirl_core.report.run_report import RunReport, StepRecord, line_chart_svg, rewards_csv, step_seconds
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch, TokenSegment


def _batch(step: int) -> SampleBatch:
    b = SampleBatch.from_prompts([PromptRecord(prompt_id=f"q{i}", prompt=f"{i}+1=") for i in range(2)],
                                 samples_per_prompt=2, kind="ar", sampling=ARSamplingParams(max_new_tokens=2))
    for k, s in enumerate(b):
        p = s.generated
        p.segment = TokenSegment(prompt_ids=torch.arange(3), response_ids=torch.arange(2),
                                 log_probs=torch.zeros(2), response_mask=torch.ones(2, dtype=torch.bool),
                                 finish_reason="stop")
        p.text, p.rewards, p.reward, p.advantage = f"ans{k}", {"acc": float(k % 2)}, float(k % 2) + step, k - 1.5
    return b


def test_steps_artifacts_and_index(tmp_path):
    report = RunReport(str(tmp_path / "run"))
    report.write_config({"name": "run", "loop": {"total_steps": 3}})
    for step in (1, 2, 3):
        report.record_step(step, metrics={"reward/mean": 0.1 * step, "train/loss": 1.0 / step,
                                          "train/ratio_mean": 1.0}, batch=_batch(step),
                           pages={"train": "<p>train page</p>"}, session="s")
    assert report.render(title="run run").endswith("report/index.html")
    index = (tmp_path / "run" / "report" / "index.html").read_text()
    assert index.count("class='step-row'") == 3
    assert 'data-metric="reward/mean"' in index and ">step<" in index  # a chart with its axis label
    assert "&quot;total_steps&quot;: 3" in index  # the config is rendered
    assert "step-00000002/train.html" in index and "ans1" in index  # page links and the text strip
    rows = list(csv.DictReader(io.StringIO((tmp_path / "run/report/step-00000002/rewards.csv").read_text())))
    assert [r["reward"] for r in rows] == ["2.0", "3.0", "2.0", "3.0"] and rows[1]["acc"] == "1.0"
    rec = json.loads((tmp_path / "run/report/step-00000003/metrics.json").read_text())
    assert rec["metrics"]["train/loss"] == pytest.approx(1 / 3) and rec["pages"] == {"train": "train.html"}
    assert [r.step for r in report.steps()] == [1, 2, 3]


def test_summary_serves_the_index_and_is_rebuilt_when_lost(tmp_path):
    report = RunReport(str(tmp_path))
    for step in (2, 1, 3):
        report.record_step(step, metrics={"reward/mean": float(step)})
    summary = tmp_path / "report" / "steps.json"
    assert [r["step"] for r in json.loads(summary.read_text())] == [1, 2, 3]
    (tmp_path / "report" / "step-00000002" / "metrics.json").unlink()
    assert [r.step for r in report.steps()] == [1, 2, 3]  # served from the summary, no per-step reads
    summary.unlink()
    assert [r.step for r in report.steps()] == [1, 3]  # rebuilt from the step folders
    report.record_step(4, metrics={})
    assert [r["step"] for r in json.loads(summary.read_text())] == [1, 3, 4]


def test_rerecording_a_step_replaces_it(tmp_path):
    report = RunReport(str(tmp_path))
    report.record_step(1, metrics={"reward/mean": 0.0})
    report.record_step(1, metrics={"reward/mean": 5.0})
    (rec,) = report.steps()
    assert rec.metrics == {"reward/mean": 5.0}


def test_step_times_and_progress_line():
    recs = [StepRecord(step=1, time=100.0, session="a", metrics={"reward/mean": 0.5, "time/train": 2.0}),
            StepRecord(step=2, time=103.0, session="a", metrics={"reward/mean": 0.6, "train/ratio_mean": 1.0}),
            StepRecord(step=3, time=500.0, session="b", metrics={"time/rollout": 1.5, "time/train": 0.5}),
            StepRecord(step=4, time=505.0, session="b", metrics={"reward/mean": 0.7})]
    assert step_seconds(recs, "a") == [3.0] and step_seconds(recs, "b") == [5.0]
    # a session's first step has no predecessor: its phase compute time stands in
    assert progress(recs[:3], recs[2], 10, "b") == progress_line_of(3, 10, recs[2].metrics, 2.0, 2.0 * 7)
    line = progress(recs, recs[3], 10, "b")
    assert line.startswith("step 4/10 | reward 0.7000") and "step 5.0s" in line and "ETA 30s" in line


def progress_line_of(step, total, metrics, sec, eta):
    from unirl_core.loop.local import progress_line
    return progress_line(step, total, metrics, sec, eta)


def test_phase_pages_are_light():
    b = _batch(0)
    html = reward_html(b, {"reward/mean": 0.5}) + advantage_html(b, {}) + histogram_svg([0.0, 1.0, 1.0])
    assert "<script" not in html and html.count("<tr>") >= 6 and "acc" in html
    assert ">q0<" in advantage_html(b, {}) and "<svg" in reward_html(b, {})
    pub = publish_html({"step": 2, "files": {"model.safetensors": {"bytes": 10, "sha256": "ab" * 32}}})
    assert "model.safetensors" in pub and "ab" * 32 in pub
    assert line_chart_svg([(1, float("nan"))], title="x") == ""
    assert rewards_csv(b).splitlines()[0] == "sample_id,group_id,reward,acc,advantage,valid,policy_version"
