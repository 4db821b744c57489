"""math-verify correctness (also off the main thread), format regex, DAPO overlong penalty."""

import threading
import time

import pytest

from unirl_core.errors import RewardError
from unirl_core.reward import ScoreItem, build_scorer


@pytest.fixture(scope="module")
def math_scorer():
    return build_scorer("math", timeout_s=10.0)


def _m(text, answer):
    return ScoreItem(text=text, targets={"answer": answer})


def test_math_correctness(math_scorer):
    items = [_m(r"so the result is \boxed{42}", "42"), _m("the answer is 41", "42"),
             _m(r"$\frac{1}{2}$", "0.5"), _m(r"we get \boxed{\frac{3}{6}}", r"\frac12")]
    assert math_scorer(items) == [1.0, 0.0, 1.0, 1.0]


def test_math_in_worker_thread(math_scorer):
    # math-verify's own timeout uses signal.alarm, which raises outside the main thread.
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", math_scorer([_m(r"\boxed{7}", "7")])))
    t.start()
    t.join(30)
    assert box["v"] == [1.0]


def test_math_bounded_time(math_scorer, monkeypatch):
    def slow_parse(*a, **k):
        time.sleep(2.0)
        return []
    scorer = build_scorer("math", timeout_s=0.2)
    monkeypatch.setattr(scorer, "_parse", lambda text, **k: slow_parse() if "slow" in text else ["1"])
    start = time.perf_counter()
    with pytest.raises(RewardError, match="longer than 0.2 s"):
        scorer.score_one(_m("slow", "1"))
    assert time.perf_counter() - start < 1.5


def test_math_missing_answer(math_scorer):
    with pytest.raises(RewardError, match="targets has no 'answer'"):
        math_scorer([ScoreItem(text="1")])


def test_format():
    fmt = build_scorer("format")
    items = [ScoreItem(text="<think>a\nb</think>\n<answer>4</answer>"), ScoreItem(text="4"),
             ScoreItem(text="<answer>four</answer><think>x</think>")]
    assert fmt(items) == [1.0, 0.0, 0.0]
    assert build_scorer("format", pattern=r"\d+", mode="search", reward_miss=-1.0)(items[1:]) == [1.0, -1.0]


def test_length_penalty_golden():
    lp = build_scorer("length_penalty", max_length=10, cache=4)
    # soft limit 6: 0 up to 6, (6 - n) / 4 up to 10, -1 beyond
    got = lp([ScoreItem(text="x", num_tokens=n) for n in (5, 6, 7, 8, 10, 11)])
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert build_scorer("length_penalty", max_length=4, cache=2, unit="chars")([ScoreItem(text="abc")]) == [-0.5]
    with pytest.raises(RewardError, match="TokenSegment"):
        lp([ScoreItem(text="abc")])
