"""report.index_every_n_steps: which steps re-render the run report's index, and its validation."""

from __future__ import annotations

import pytest

from unirl_core.config import load_recipe
from unirl_core.config.run import ReportConfig
from unirl_core.errors import ConfigError


def test_index_renders_at_the_first_every_nth_and_last_step():
    rc = ReportConfig(index_every_n_steps=4)
    assert [s for s in range(1, 11) if rc.renders_index(s, 10)] == [1, 4, 8, 10]
    assert all(ReportConfig(index_every_n_steps=1).renders_index(s, 5) for s in range(1, 6))
    assert ReportConfig().index_every_n_steps == 10


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_bad_index_interval_names_the_field(value):
    with pytest.raises(ConfigError, match="report.index_every_n_steps"):
        ReportConfig(index_every_n_steps=value)


def test_recipe_override_reaches_the_config():
    assert load_recipe("tiny-grpo", ["report.index_every_n_steps=3"]).report.index_every_n_steps == 3
