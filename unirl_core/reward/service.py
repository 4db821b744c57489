"""RewardService: score a SampleBatch with weighted components, locally or through a reward server."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field

from unirl_core.errors import RewardError
from unirl_core.reward.client import RemoteRewardClient
from unirl_core.reward.config import RewardComponent, RewardConfig
from unirl_core.reward.scorers.base import ComponentScores, ScoreItem, Scorer, build_scorer, run_scorer
from unirl_core.types import SampleBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RewardStats:
    """What one ``score`` call did."""

    num_samples: int
    num_invalid: int
    """Samples marked invalid by this call (only under ``mark_invalid``)."""
    failures: dict[str, int] = field(default_factory=dict)
    """Component -> number of samples where it raised or returned NaN/inf."""
    component_mean: dict[str, float] = field(default_factory=dict)
    """Component -> mean of its finite values (nan if none)."""
    reward_mean: float = math.nan
    """Mean weighted total over valid samples."""
    seconds: float = 0.0

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        out = {f"{prefix}num_samples": float(self.num_samples), f"{prefix}num_invalid": float(self.num_invalid),
               f"{prefix}mean": self.reward_mean, f"{prefix}seconds": self.seconds}
        out.update({f"{prefix}{k}/mean": v for k, v in self.component_mean.items()})
        out.update({f"{prefix}{k}/failures": float(v) for k, v in self.failures.items()})
        return out


class RewardService:
    """Holds one backend (local scorers or a remote client) and applies the failure policy.

    ``score`` mutates the generated Part of every Sample in place (``rewards[name]``, ``reward``,
    ``valid``) and returns the same batch object. Local scorers are built on first use.
    """

    def __init__(self, cfg: RewardConfig, *, scorers: dict[str, Scorer] | None = None,
                 client: RemoteRewardClient | None = None) -> None:
        self.cfg = cfg
        self._scorers: dict[str, Scorer] = dict(scorers or {})
        self._client = client
        if cfg.backend == "remote" and client is None:
            self._client = RemoteRewardClient(cfg.remote_url, token=os.environ.get(cfg.remote_token_env),
                                              timeout_s=cfg.remote_timeout_s, retries=cfg.remote_retries,
                                              backoff_s=cfg.remote_backoff_s,
                                              max_in_flight=cfg.remote_max_in_flight)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> RewardService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _scorer(self, comp: RewardComponent) -> Scorer:
        if comp.name not in self._scorers:
            self._scorers[comp.name] = build_scorer(comp.name, **comp.kwargs)
        return self._scorers[comp.name]

    def _score_chunks(self, chunks: list[list[ScoreItem]], isolate: bool) -> list[list[ComponentScores]]:
        """Per chunk, per component: the scores."""
        comps = self.cfg.components
        if self.cfg.backend == "remote":
            return self._client.score_chunks(comps, chunks, isolate=isolate)
        return [[run_scorer(self._scorer(c), items, name=c.name, isolate=isolate) for c in comps]
                for items in chunks]

    def score(self, batch: SampleBatch) -> SampleBatch:
        """Score every Sample's generated Part; see ``score_with_stats``."""
        return self.score_with_stats(batch)[0]

    def score_with_stats(self, batch: SampleBatch) -> tuple[SampleBatch, RewardStats]:
        """Score in chunks of ``cfg.batch_size``; raise RewardError or mark invalid per the failure policy."""
        start = time.perf_counter()
        parts = batch.generated
        isolate = self.cfg.failure_policy == "mark_invalid"
        results: list[list[float]] = [[] for _ in self.cfg.components]
        errors: list[list[str | None]] = [[] for _ in self.cfg.components]
        chunks = [[ScoreItem.from_part(p) for p in parts[lo:lo + self.cfg.batch_size]]
                  for lo in range(0, len(parts), self.cfg.batch_size)]
        for chunk_scores in self._score_chunks(chunks, isolate):
            for k, res in enumerate(chunk_scores):
                results[k].extend(res.values)
                errors[k].extend(res.errors)
        failed = self._check(batch, results, errors)
        stats = self._write(batch, results, failed)
        stats = dataclasses.replace(stats, seconds=time.perf_counter() - start)
        logger.info("scored %d samples in %.2f s (%d invalid)", len(parts), stats.seconds, stats.num_invalid)
        return batch, stats

    def _check(self, batch: SampleBatch, results: list[list[float]],
               errors: list[list[str | None]]) -> list[set[int]]:
        """Per component, the sample indices that failed; under ``fail`` raise on the first failing component."""
        failed: list[set[int]] = []
        for comp, vals, errs in zip(self.cfg.components, results, errors):
            bad = {i for i, (v, e) in enumerate(zip(vals, errs)) if e is not None or not math.isfinite(v)}
            if bad and self.cfg.failure_policy == "fail":
                shown = sorted(bad)[:3]
                detail = "; ".join(f"{batch.samples[i].sample_id}: {errs[i] or vals[i]}" for i in shown)
                raise RewardError(
                    f"reward component {comp.name!r} failed on {len(bad)}/{len(vals)} samples ({detail}); "
                    "fix the scorer or inputs, or set reward.failure_policy='mark_invalid' to drop such samples")
            failed.append(bad)
        return failed

    def _write(self, batch: SampleBatch, results: list[list[float]], failed: list[set[int]]) -> RewardStats:
        any_failed = set().union(*failed)
        totals = []
        for i, part in enumerate(batch.generated):
            part.rewards = {c.name: results[k][i] for k, c in enumerate(self.cfg.components) if i not in failed[k]}
            if i in any_failed:
                part.valid, part.reward = False, None
                continue
            part.valid = True
            part.reward = float(sum(c.weight * results[k][i] for k, c in enumerate(self.cfg.components)))
            totals.append(part.reward)
        means = {}
        for k, c in enumerate(self.cfg.components):
            ok = [v for v in results[k] if math.isfinite(v)]
            means[c.name] = sum(ok) / len(ok) if ok else math.nan
        return RewardStats(num_samples=len(batch), num_invalid=len(any_failed),
                           failures={c.name: len(f) for c, f in zip(self.cfg.components, failed)},
                           component_mean=means, reward_mean=sum(totals) / len(totals) if totals else math.nan)
