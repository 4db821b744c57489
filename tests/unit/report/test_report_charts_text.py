"""The index's chart sections and spread sample strips, and completion text without U+FFFD (the charts themselves:
test_charts.py)."""

from __future__ import annotations

import re

import pytest

from unirl_core.report.run_report import STRIP_STEPS, RunReport, strip_steps
from unirl_core.report.text import complete_utf8_prefix, decode_completion, display_html


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
