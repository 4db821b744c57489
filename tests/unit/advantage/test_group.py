"""Golden tests of the pure group-normalisation math against hand-computed values."""

import math

import pytest
import torch

from unirl_core.advantage import AdvantageConfig, group_advantages, group_moments, zero_std_groups
from unirl_core.errors import ConfigError, InvariantError


def _adv(rewards, groups, **kw):
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(groups, dtype=torch.int64)
    return group_advantages(r, g, AdvantageConfig(**kw)).tolist()


def test_two_siblings_population_std_gives_plus_minus_one():
    # mean 0.5, population std 0.5 -> (0 - .5)/.5 = -1, (1 - .5)/.5 = 1
    assert _adv([0.0, 1.0], [0, 0], eps=0.0) == pytest.approx([-1.0, 1.0], abs=1e-12)


def test_unbiased_std_two_siblings():
    # std with n-1: sqrt(0.5) = 0.70710678 -> +-0.5/0.70710678 = +-0.70710678
    assert _adv([0.0, 1.0], [0, 0], eps=0.0, unbiased_std=True) == pytest.approx([-0.70710678, 0.70710678], abs=1e-8)


def test_eps_and_constant_group():
    # group 0: mean 2.5, population std sqrt(1.25); group 1 is constant -> 0, never nan
    got = _adv([1, 2, 3, 4, 10, 10], [0, 0, 0, 0, 1, 1])
    d = math.sqrt(1.25) + 1e-4
    assert got == pytest.approx([-1.5 / d, -0.5 / d, 0.5 / d, 1.5 / d, 0.0, 0.0], abs=1e-12)
    assert 1.5 / d == pytest.approx(1.341520, abs=1e-6)


def test_non_adjacent_siblings():
    # group 0 = {5, 7}: mean 6 std 1; group 1 = {1, 3}: mean 2 std 1
    assert _adv([5, 1, 7, 3], [0, 1, 0, 1], eps=0.0) == pytest.approx([-1, -1, 1, 1], abs=1e-12)


def test_global_std_and_none():
    # global mean irrelevant; centring is per group (means 1 and 1); global population std sqrt(0.5)
    assert _adv([0, 2, 1, 1], [0, 0, 1, 1], eps=0.0, std_scope="global") == pytest.approx(
        [-1.41421356, 1.41421356, 0, 0], abs=1e-8)
    assert _adv([0, 2, 1, 1], [0, 0, 1, 1], std_scope="none") == pytest.approx([-1, 1, 0, 0], abs=1e-12)


def test_clip():
    # nine 0s and one 1: mean .1, std .3 -> the 1 gets .9/.3 = 3, the zeros -1/3; clip at 2
    got = _adv([0] * 9 + [1], [0] * 10, eps=0.0, clip=2.0)
    assert got == pytest.approx([-1 / 3] * 9 + [2.0], abs=1e-12)


def test_unbiased_singleton_is_zero_not_nan():
    assert _adv([3.0, 4.0, 5.0], [0, 1, 1], unbiased_std=True, eps=0.0)[0] == 0.0


def test_dtype_preserved_and_moments():
    r = torch.tensor([1.0, 3.0], dtype=torch.float32)
    out = group_advantages(r, torch.tensor([0, 0]), AdvantageConfig())
    assert out.dtype == torch.float32
    count, mean, std = group_moments(torch.tensor([1.0, 3.0, 8.0]), torch.tensor([0, 0, 1]))
    assert count.tolist() == [2, 1] and mean.tolist() == [2, 8] and std.tolist() == [1, 0]


def test_zero_std_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0])
    assert zero_std_groups(r, torch.tensor([0, 0, 1, 1, 2])).tolist() == [True, False, True]


def test_rejects_non_finite_and_bad_index():
    with pytest.raises(InvariantError, match="rewards"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), AdvantageConfig())
    with pytest.raises(InvariantError, match="group_index"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0], dtype=torch.int32), AdvantageConfig())
    with pytest.raises(InvariantError, match="indices >= 0"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, -1]), AdvantageConfig())


def test_config_validation():
    with pytest.raises(ConfigError, match="std_scope"):
        AdvantageConfig(std_scope="batch")
    with pytest.raises(ConfigError, match="clip"):
        AdvantageConfig(clip=0.0)
    with pytest.raises(ConfigError, match="eps"):
        AdvantageConfig(eps=-1.0)
