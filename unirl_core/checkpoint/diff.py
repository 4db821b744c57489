"""Where two versions differ, bit for bit: weights, EMA weights, the full train state, the extra JSON.

Replay trains step k again and compares its version with the one the run stored (``unirl_core/runs/replay.py``).
``config.json`` is not compared: it is the input (the replayed version is written under another root).
"""

from __future__ import annotations

from collections.abc import Mapping

from unirl_core.checkpoint.store import EMA, EXTRA, TRAIN_STATE, WEIGHTS, LoadedCheckpoint
from unirl_core.io.diff import Difference, same_bits


def _first_key(stored: Mapping, replayed: Mapping, path: str) -> Difference | None:
    """The first entry (depth first, keys sorted) of two nested mappings whose bits differ."""
    if stored.keys() != replayed.keys():
        missing = sorted(map(str, stored.keys() ^ replayed.keys()))[:4]
        return Difference(path, "keys", sorted(map(str, stored.keys()))[:8], f"keys differ: {missing}")
    for key in sorted(stored, key=str):
        a, b = stored[key], replayed[key]
        where = f"{path}[{key!r}]"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            if (d := _first_key(a, b, where)) is not None:
                return d
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and \
                any(isinstance(x, Mapping) for x in a):
            if (d := _first_key(dict(enumerate(a)), dict(enumerate(b)), where)) is not None:
                return d
        elif not same_bits(a, b):
            return Difference(where, "value", a, b)
    return None


def first_version_difference(stored: LoadedCheckpoint, replayed: LoadedCheckpoint) -> Difference | None:
    """The first file entry in which ``replayed`` differs from ``stored``: policy version, ``model.safetensors``,
    ``ema.safetensors``, ``train_state.pt`` (optimizer, RNG, counters), ``extra.json``; None when equal."""
    prefix = f"version {stored.ref.step}"
    if stored.ref.policy_version != replayed.ref.policy_version:
        return Difference(f"{prefix} policy_version", "manifest", stored.ref.policy_version,
                          replayed.ref.policy_version)
    pairs = ((WEIGHTS, stored.weights, replayed.weights), (EMA, stored.ema_weights, replayed.ema_weights),
             (TRAIN_STATE, stored.train_state, replayed.train_state), (EXTRA, stored.extra, replayed.extra))
    for name, a, b in pairs:
        if a is None or b is None:
            if (a is None) != (b is None):
                return Difference(f"{prefix} {name}", "file", "present" if a is not None else "absent",
                                  "present" if b is not None else "absent")
            continue
        if (d := _first_key(a, b, f"{prefix} {name}")) is not None:
            return d
    return None
