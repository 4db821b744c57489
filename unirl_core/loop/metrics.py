"""How per-shard and per-rank metrics of one step combine (no torch: tasks import it at package time)."""

from __future__ import annotations


def merge_shard_metrics(per_shard: list[dict[str, float]]) -> dict[str, float]:
    """One step's rollout metrics from its shards' (shards run in parallel): counts add up, times take the
    slowest shard, ``*_max`` the maximum and ``*_min`` the minimum, anything else is averaged."""
    out: dict[str, float] = {}
    for key in sorted({k for m in per_shard for k in m}):
        vals = [m[key] for m in per_shard if key in m]
        if key.startswith("time/") or key.endswith("seconds") or key.endswith("_max"):
            out[key] = max(vals)
        elif key.endswith("_min"):
            out[key] = min(vals)
        elif key.endswith("samples"):
            out[key] = sum(vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out
