"""Climb statistics against hand-computed values, and curves that must pass or fail."""

import math

import numpy as np
import pytest

from unirl_core.errors import ConfigError
from unirl_core.report.climb import ClimbCriteria, climb_stats, spearman


def test_golden_values():
    r = [0.0, 0.2, 0.1, 0.3, 0.2, 0.4, 0.3, 0.5, 0.4, 0.6]
    s = climb_stats(r)
    # thirds of 3 steps: [0, .2, .1], [.3, .2, .4], [.3, .5, .4]; tenths of 1 step
    assert s.thirds == pytest.approx((0.1, 0.3, 0.4))
    assert (s.first_tenth, s.last_tenth) == pytest.approx((0.0, 0.6))
    # differences: five +.2 and four -.1, mean 1/15; variance (5 * (2/15)^2 + 4 * (1/6)^2) / 9 = 0.2 / 9
    assert s.noise_std == pytest.approx(math.sqrt(0.2 / 9) / math.sqrt(2))
    assert s.z == pytest.approx(0.6 / math.sqrt(0.1 / 9))
    # ranks of r: 1, 3.5... by hand: values sorted 0,.1,.2,.2,.3,.3,.4,.4,.5,.6 -> ties share average ranks
    ranks = [1, 3.5, 2, 5.5, 3.5, 7.5, 5.5, 9, 7.5, 10]
    assert s.spearman == pytest.approx(np.corrcoef(np.arange(10), ranks)[0, 1])
    assert s.failures() == []


def test_drift_and_short_curves_fail():
    rng = np.random.default_rng(0)
    drift = 0.3 + 0.0005 * np.arange(60) + rng.normal(0, 0.05, 60)  # a drift: +0.03 over the run
    failures = climb_stats(drift).failures()
    assert any("noise std" in f for f in failures) and any("Spearman" in f for f in failures)
    climb = 0.3 + 0.006 * np.arange(60) + rng.normal(0, 0.05, 60)  # +0.36 over the run
    assert climb_stats(climb).failures() == []
    assert "only 6 steps" in climb_stats([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).failures()[0]
    assert climb_stats([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).failures(ClimbCriteria(min_steps=6)) == []
    falls = climb_stats([0.5, 0.4, 0.3, 0.2, 0.1, 0.0, 0.1, 0.0, 0.1])
    assert any("thirds not increasing" in f for f in falls.failures())
    assert math.isnan(spearman([1, 2, 3], [1, 1, 1]))
    with pytest.raises(ConfigError, match="rewards"):
        climb_stats([0.1, float("nan"), 0.2])
