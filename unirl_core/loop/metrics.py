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


def join_shards(batches: list, per_shard: list[dict[str, float]]) -> tuple:
    """One step's rollout from its shards, in shard order: the batches concatenated (the first shard's metadata
    without its ``shard`` key) and the metrics merged (``merge_shard_metrics``). One shard: its batch's samples
    and its metrics as they are, so the single rollout task and the map + join path give the same output."""
    from unirl_core.types import SampleBatch

    meta = {k: v for k, v in batches[0].metadata.items() if k != "shard"}
    return SampleBatch.concat(batches, metadata=meta), merge_shard_metrics(per_shard)
