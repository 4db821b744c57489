"""RewardService: weighted totals, chunking, and the failure policy both ways (raise and NaN/inf)."""

import math

import pytest

from unirl_core.errors import ConfigError, RewardError
from unirl_core.reward import RewardComponent, RewardConfig, RewardService, run_scorer
from tests.unit.reward.conftest import text_batch


class Length:
    """len(text); records each call's batch size."""

    def __init__(self):
        self.calls = []

    def __call__(self, items):
        self.calls.append(len(items))
        return [float(len(it.text)) for it in items]


class Picky:
    """Returns NaN or inf for texts 'nan' / 'inf', raises on 'boom' (whole call), else 1.0."""

    def __call__(self, items):
        if any(it.text == "boom" for it in items):
            raise ValueError("boom in batch")
        return [{"nan": math.nan, "inf": math.inf}.get(it.text, 1.0) for it in items]


def _service(policy="fail", batch_size=32):
    cfg = RewardConfig(components=[("length", 0.5, {}), ("picky", 2.0, {})], failure_policy=policy,
                       batch_size=batch_size)
    return RewardService(cfg, scorers={"length": Length(), "picky": Picky()})


def test_weighted_total_and_components():
    batch = text_batch(["ab", "abcd"])
    out, stats = _service().score_with_stats(batch)
    assert out is batch
    g = [s.generated for s in batch]
    assert [p.rewards for p in g] == [{"length": 2.0, "picky": 1.0}, {"length": 4.0, "picky": 1.0}]
    assert [p.reward for p in g] == [0.5 * 2 + 2.0, 0.5 * 4 + 2.0]
    assert all(p.valid for p in g) and stats.num_invalid == 0 and stats.reward_mean == 3.5
    assert stats.component_mean == {"length": 3.0, "picky": 1.0}


def test_chunks_follow_batch_size():
    svc = _service(batch_size=2)
    svc.score(text_batch(["a", "b", "c", "d", "e"]))
    assert svc._scorers["length"].calls == [2, 2, 1]


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_fail_policy_raises_on_non_finite(bad):
    with pytest.raises(RewardError, match=rf"'picky' failed on 1/3 samples \(p/1: {bad}\)") as e:
        _service("fail").score(text_batch(["ok", bad, "ok"]))
    assert "mark_invalid" in str(e.value)


def test_fail_policy_raises_on_exception_for_the_whole_batch():
    # Without isolation a raising call fails all its items; the cause travels in the message.
    with pytest.raises(RewardError, match=r"'picky' failed on 3/3 samples \(p/0: ValueError: boom in batch"):
        _service("fail").score(text_batch(["ok", "boom", "ok"]))


@pytest.mark.parametrize("bad", ["nan", "inf", "boom"])
def test_mark_invalid_excludes_only_the_bad_sample(bad):
    batch = text_batch(["ok", bad, "fine"])
    _, stats = _service("mark_invalid").score_with_stats(batch)
    g = [s.generated for s in batch]
    assert [p.valid for p in g] == [True, False, True]
    assert g[1].reward is None and "picky" not in g[1].rewards and g[1].rewards["length"] == len(bad)
    assert g[0].reward == 0.5 * 2 + 2.0 and g[2].reward == 0.5 * 4 + 2.0  # neighbours unharmed, never zeroed
    assert stats.num_invalid == 1 and stats.failures == {"length": 0, "picky": 1}
    assert stats.as_metrics()["reward/picky/failures"] == 1.0


def test_rescoring_restores_validity():
    batch = text_batch(["nan"])
    _service("mark_invalid").score(batch)
    batch.samples[0].generated.text = "ok"
    _service("mark_invalid").score(batch)
    assert batch.samples[0].generated.valid and batch.samples[0].generated.reward == 3.0


def test_run_scorer_without_isolation_fails_every_item():
    from unirl_core.reward import ScoreItem
    res = run_scorer(Picky(), [ScoreItem(text="ok"), ScoreItem(text="boom")], name="picky", isolate=False)
    assert all(e == "ValueError: boom in batch" for e in res.errors) and all(math.isnan(v) for v in res.values)
    with pytest.raises(RewardError, match="returned 1 values for 2 items"):  # a bug, not a per-item failure
        run_scorer(lambda items: [1.0], [ScoreItem(), ScoreItem()], name="short", isolate=True)


def test_config_validation():
    with pytest.raises(ConfigError, match="components"):
        RewardConfig(components=[])
    with pytest.raises(ConfigError, match="distinct"):
        RewardConfig(components=[("ocr", 1.0, {}), ("ocr", 2.0, {})])
    with pytest.raises(ConfigError, match="remote_url"):
        RewardConfig(components=[("ocr", 1.0, {})], backend="remote")
    with pytest.raises(ConfigError, match="failure_policy"):
        RewardConfig(components=[("ocr", 1.0, {})], failure_policy="ignore")
    with pytest.raises(ConfigError, match="JSON"):
        RewardComponent(name="ocr", kwargs={"x": object()})
    cfg = RewardConfig(components=[("jpeg_compressibility", 1.0)])
    assert cfg.components == (RewardComponent(name="jpeg_compressibility", weight=1.0),)


def test_unknown_component_and_bad_kwargs():
    with pytest.raises(ConfigError, match="one of"):
        RewardService(RewardConfig(components=[("no_such_scorer", 1.0, {})])).score(text_batch(["a"]))
    with pytest.raises(ConfigError, match="kwargs"):
        RewardService(RewardConfig(components=[("format", 1.0, {"colour": "red"})])).score(text_batch(["a"]))
