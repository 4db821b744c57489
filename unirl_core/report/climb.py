"""Does a reward curve climb, or drift? The statistics a "visibly learns" claim is held to.

A run's per-step mean reward ``r_1..r_n`` climbs (``ClimbCriteria`` defaults) when

- the mean of each third of the run is above the mean of the previous third (thirds of ``n // 3`` steps; a
  remainder is left out at the end);
- the mean of the last tenth (``max(1, n // 10)`` steps) is at least ``min_z`` standard deviations of the
  step-to-step noise above the mean of the first tenth. The noise is ``std(r_{t+1} - r_t) / sqrt(2)``: for a
  smooth trend plus independent per-step noise of std ``s`` the differences have std ``s * sqrt(2)``, and a
  trend of a few hundredths over a step barely moves it, so a slow climb does not inflate its own yardstick;
- Spearman's rank correlation of reward and step is at least ``min_spearman``.

Pure numpy; used by the climb tests and the README's measured numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from unirl_core.errors import ConfigError, field_error


@dataclass(frozen=True, kw_only=True)
class ClimbCriteria:
    """Thresholds of a climb (the defaults are the "first run that visibly learns" ones)."""

    min_z: float = 3.0
    """Last tenth minus first tenth, in step-to-step noise standard deviations, at least this."""
    min_spearman: float = 0.6
    """Rank correlation of reward and step at least this."""
    min_steps: int = 9
    """Shortest curve the statistics mean anything for (three thirds of three steps)."""


@dataclass(frozen=True, kw_only=True)
class ClimbStats:
    """The statistics of one reward curve."""

    steps: int
    """Points in the curve."""
    thirds: tuple[float, float, float]
    """Mean reward of each third."""
    first_tenth: float
    """Mean of the first ``max(1, n // 10)`` points."""
    last_tenth: float
    """Mean of the last ``max(1, n // 10)`` points."""
    noise_std: float
    """Step-to-step noise: ``std(diff(r)) / sqrt(2)``."""
    z: float
    """``(last_tenth - first_tenth) / noise_std`` (inf when the curve has no noise and rose)."""
    spearman: float
    """Rank correlation of reward and step (average ranks for ties)."""

    def failures(self, criteria: ClimbCriteria | None = None) -> list[str]:
        """What this curve misses of ``criteria`` (empty: it climbs)."""
        c = criteria or ClimbCriteria()
        out = []
        if self.steps < c.min_steps:
            out.append(f"only {self.steps} steps (< {c.min_steps})")
        a, b, d = self.thirds
        if not a < b < d:
            out.append(f"thirds not increasing: {a:.4f} / {b:.4f} / {d:.4f}")
        if not self.z >= c.min_z:
            out.append(f"last tenth {self.last_tenth:.4f} is {self.z:.2f} noise std ({self.noise_std:.4f}) above "
                       f"the first tenth {self.first_tenth:.4f} (< {c.min_z})")
        if not self.spearman >= c.min_spearman:
            out.append(f"Spearman(reward, step) {self.spearman:.3f} < {c.min_spearman}")
        return out

    def summary(self) -> str:
        """One line: thirds, tenths, z, Spearman."""
        return (f"thirds {' / '.join(f'{t:.3f}' for t in self.thirds)}, first/last tenth {self.first_tenth:.3f} -> "
                f"{self.last_tenth:.3f} ({self.z:.1f} noise std of {self.noise_std:.3f}), Spearman {self.spearman:.2f}")


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tied = x == v
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson correlation of the average ranks); nan when one side is constant."""
    rx, ry = _ranks(np.asarray(x, dtype=np.float64)), _ranks(np.asarray(y, dtype=np.float64))
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def climb_stats(rewards: Sequence[float]) -> ClimbStats:
    """The climb statistics of a per-step reward curve (step order)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or len(r) < 3 or not np.isfinite(r).all():
        raise field_error(ConfigError, "rewards", f"{len(r)} values", "at least 3 finite per-step rewards",
                          "pass the run's reward/mean history")
    n = len(r)
    t, d = n // 3, max(1, n // 10)
    thirds = tuple(float(r[i * t:(i + 1) * t].mean()) for i in range(3))
    first, last = float(r[:d].mean()), float(r[-d:].mean())
    noise = float(np.diff(r).std() / math.sqrt(2))
    rise = last - first
    z = rise / noise if noise > 0 else (math.inf if rise > 0 else 0.0)
    return ClimbStats(steps=n, thirds=thirds, first_tenth=first, last_tenth=last, noise_std=noise, z=z,
                      spearman=spearman(np.arange(n), r))
