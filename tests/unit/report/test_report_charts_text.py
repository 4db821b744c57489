"""Report charts (axes, EMA, bounded size), spread sample strips, and completion text without U+FFFD."""

from __future__ import annotations

import re

import numpy as np
import pytest

from unirl_core.report.charts import (
    downsample,
    ema,
    histogram_counts,
    histogram_svg,
    line_chart_svg,
    nice_ticks,
)
from unirl_core.report.run_report import STRIP_STEPS, RunReport, strip_steps
from unirl_core.report.text import complete_utf8_prefix, decode_completion, display_html

NUM = re.compile(r"^[\u2212\-]?\d+(\.\d+)?$")


def _ticks(svg: str) -> list[str]:
    return [t.strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg) if NUM.match(t.strip())]


def test_chart_has_axes_ticks_labels_and_ema():
    svg = line_chart_svg([(s, 0.1 * s) for s in range(1, 11)], title="reward/mean", smooth=0.6)
    assert svg.startswith('<svg class="curve" data-metric="reward/mean"') and "<?xml" not in svg
    assert len(_ticks(svg)) >= 6 and ">step<" in svg and ">EMA 0.6<" in svg
    assert ">EMA" not in line_chart_svg([(1, 0.0), (2, 1.0), (3, 2.0)], title="x", smooth=None)
    assert line_chart_svg([(1, float("nan"))], title="x") == ""
    one = line_chart_svg([(5, 1.0)], title="single")
    assert {"4", "5", "6"} <= set(_ticks(one))


def test_long_runs_keep_charts_small():
    pts = [(s, (s % 7) / 7) for s in range(20_000)]
    assert len(downsample(pts)) == 500 and downsample(pts)[-1] == pts[-1]
    assert len(line_chart_svg(pts, title="long")) < 60_000
    assert ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # bias-corrected: no pull towards 0


def test_histogram_has_axes():
    svg = histogram_svg([0.0, 0.5, 1.0, 1.0])
    assert 'class="histogram"' in svg and len(_ticks(svg)) >= 4
    assert svg.count("<rect") == 3 and ">count<" in svg  # a bar per non-empty bin
    assert len(_ticks(histogram_svg([-0.0071, -0.0068, -0.0065, -0.0064]))) >= 4  # small ranges keep their ticks


@pytest.mark.parametrize("seed,bins", [(0, 12), (1, 7), (2, 3)])
def test_histogram_bins_as_numpy(seed, bins):
    rng = np.random.default_rng(seed)
    xs = np.concatenate([rng.normal(size=200), np.linspace(-1, 1, 13), [0.1, 0.1, 0.3]]).tolist()
    lo, hi, counts = histogram_counts(xs, bins)
    ref, edges = np.histogram(xs, bins=bins)
    assert counts == ref.tolist() and (lo, hi) == (edges[0], edges[-1])
    assert histogram_counts([2.0, 2.0], 4) == (1.5, 2.5, [0, 0, 2, 0])  # one value: its +- 0.5 range


def test_nice_ticks_are_round_and_inside():
    assert nice_ticks(0, 7, 4, integer=True) == [0, 2, 4, 6]
    assert nice_ticks(0.0, 1.0, 5) == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert nice_ticks(-2.3, 2.1, 5) == [-2, -1, 0, 1, 2]


@pytest.mark.parametrize("n,expected", [(3, [1, 2, 3]), (12, list(range(1, 13)))])
def test_strip_steps_short_runs_show_every_step(n, expected):
    assert strip_steps(list(range(1, n + 1))) == expected


def test_strip_steps_spread_over_the_whole_run():
    picked = strip_steps(list(range(1, 1001)))
    assert len(picked) == STRIP_STEPS and picked[0] == 1 and picked[-1] == 1000
    gaps = [b - a for a, b in zip(picked, picked[1:])]
    assert max(gaps) - min(gaps) <= 1


def test_index_embeds_spread_strips_and_says_why(tmp_path):
    from tests.flyte.test_report import _batch

    report = RunReport(str(tmp_path))
    for step in range(1, 31):
        report.record_step(step, metrics={"reward/mean": step / 30, "reward/acc/mean": 0.5, "eval/acc": 0.1,
                                          "train/ratio_mean": 1.0, "train/clip_frac": 0.0, "train/kl": 0.01,
                                          "train/logp_absdiff_mean": 0.0, "time/train": 0.1},
                           batch=_batch(step) if step in (1, 2, 15, 30) else None)
    report.render()
    index = (tmp_path / "report" / "index.html").read_text()
    assert "first, the last" in index and "class='strip-note'" in index
    for metric in ("reward/mean", "reward/acc/mean", "eval/acc", "train/ratio_mean", "train/clip_frac",
                   "train/kl", "train/logp_absdiff_mean", "time per phase"):
        assert f'data-metric="{metric}"' in index, metric
    rows = re.findall(r"<tr class='step-row' data-step='(\d+)'>(.*?)</tr>(?=<tr class='step-row'|</table>)", index)
    with_strip = [int(s) for s, body in rows if "class='samples'" in body]
    assert with_strip == [1, 30]  # of the recorded strips, 1 and 30 are among the spread steps (1, 3, 6, ...)


def _tiny():
    from unirl_core.models.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_cut_inside_a_character_is_dropped_not_replaced():
    tok = _tiny()
    ids = tok.encode("4 €é", add_special_tokens=False)
    cut = ids[:-1]  # the last byte of "é" is missing: a completion stopped by max_new_tokens
    assert tok.decode(cut).endswith("\ufffd")  # what the rollout showed before
    assert decode_completion(tok, cut) == "4 €"
    assert decode_completion(tok, ids) == "4 €é"
    assert decode_completion(tok, [*ids, tok.eos_token_id], skip_ids=[tok.eos_token_id]) == "4 €é"


def test_utf8_prefix_and_display():
    assert complete_utf8_prefix("é".encode()[:1]) == b""
    assert complete_utf8_prefix("a€".encode()[:-1]) == b"a"
    assert complete_utf8_prefix("a€".encode()) == "a€".encode()
    shown = display_html("x\ufffd\ufffdy\x85<")
    assert "\ufffd" not in shown and "[?]" in shown and "\\u0085" in shown and "&lt;" in shown


def test_index_charts_lagged_rollout_metrics():
    """A lagged run's staleness, buffer depth and IS statistics get charts; a synchronous run has no such section."""
    from unirl_core.report.run_report import StepRecord, index_body

    lag = [StepRecord(step=s, time=float(s), metrics={"reward/mean": 0.1 * s, "async/staleness_mean": min(s - 1, 1),
                                                      "async/staleness_max": min(s - 1, 1), "async/buffer_depth": 1.0,
                                                      "train/staleness_mean": min(s - 1, 1), "train/is_weight_mean": 0.9})
           for s in range(1, 5)]
    body = index_body("run", lag, None, {})
    assert "asynchronous rollouts" in body and "async/staleness_mean" in body and "train/is_weight_mean" in body
    sync = [StepRecord(step=s, time=float(s), metrics={"reward/mean": 0.1 * s}) for s in range(1, 5)]
    assert "asynchronous rollouts" not in index_body("run", sync, None, {})


def test_eval_charts_hold_every_evaluated_version_the_start_included():
    """The eval section: the starting policy (step 0, an eval record only) and each evaluated step on one reward
    chart with the components beside it; no chart for the reward's spread or the bookkeeping."""
    from unirl_core.report.eval_report import EvalRecord
    from unirl_core.report.run_report import StepRecord, _eval_charts

    evald = {"eval/reward/mean": 0.4, "eval/reward/acc/mean": 0.5, "eval/reward/std": 0.1, "eval/seconds": 2.0,
             "eval/samples": 8.0, "eval/response_tokens_mean": 3.0}
    records = [StepRecord(step=s, time=0.0, metrics={"reward/mean": 0.1 * s, **(evald if s == 4 else {})})
               for s in range(1, 5)]
    start = EvalRecord(step=0, metrics={**evald, "eval/reward/mean": 0.2, "eval/reward/acc/mean": 0.3})
    charts = _eval_charts(records, [start, EvalRecord(step=4, metrics=evald)])
    titles = [re.search(r'data-metric="([^"]+)"', c).group(1) for c in charts]
    assert titles == ["eval/reward/mean", "eval/response_tokens_mean"]
    reward = charts[0]
    assert reward.count("<circle") == 4  # two versions (step 0 and 4), the mean and the acc component each
    assert "eval/reward/acc/mean" in reward  # the legend


@pytest.mark.parametrize("values", [[1.2e-7, 3.4e-7, 2.2e-7], [-12345.5, 20000.25, 1.0], [0.5, 0.75, 0.6]])
def test_y_tick_labels_fit_left_of_the_axis(values):
    """Every y tick label (right-aligned at the axis) fits inside the chart at ~6.5 px a character, however many
    digits the range needs (a fixed margin cut long labels off)."""
    from unirl_core.report.charts import line_chart_svg

    svg = line_chart_svg(list(enumerate(values, 1)), title="train/logp_absdiff_mean", ylabel="nats")
    labels = re.findall(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="end">([^<]+)</text>', svg)
    assert len(labels) >= 3
    assert all(float(x) - 6.5 * len(text) >= 14 for x, text in labels), labels  # clear of the rotated ylabel
