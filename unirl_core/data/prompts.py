"""Prompt data sets: records from jsonl, parquet, a saved HF ``datasets`` directory or a hub dataset, at any
fsspec URI (``unirl_core/data/uri.py``).

A ``PromptDataset`` is an immutable list of ``PromptRecord`` plus a deterministic sampler:
``batch(step, n)`` returns the prompts of optimizer step ``step``. The order is a permutation
per epoch seeded by ``(seed, epoch)`` (reordered at its head so that a step spanning two epochs
never draws a prompt twice, see ``PromptDataset.epoch_order``), so any step can be recomputed
after a resume without replaying the steps before it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from unirl_core.data.uri import Where, read_rows
from unirl_core.errors import ConfigError, InvariantError, field_error
from unirl_core.types import PromptRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PromptDataConfig:
    """Where prompts come from and which fields they use."""

    path: str
    """Where the prompts are: a ``.jsonl`` / ``.json`` / ``.parquet`` file, or a ``.txt`` of one prompt per line (column
    ``prompt``: Flow-GRPO's prompt files), as a local path or any fsspec URL
    (``s3://bucket/train.jsonl``, ``https://host/train.jsonl``, ``hf://datasets/<org>/<name>/train.jsonl``), a local
    directory written by ``datasets.Dataset.save_to_disk``, or a hub dataset by id, ``hf://datasets/<org>/<name>``
    (``datasets.load_dataset``, split ``split`` or ``train``). The setup task checks it (``config/preflight.py``)."""
    prompt_field: str = "prompt"
    """Column holding the prompt text."""
    answer_field: str | None = "answer"
    """Column copied to ``targets['answer']`` for verifiable scorers; None when there is none."""
    id_field: str | None = None
    """Column with stable prompt ids; None uses ``<row index>``."""
    split: str | None = None
    """Split of a saved ``DatasetDict`` (e.g. ``train``); None for a plain ``Dataset``."""
    seed: int = 0
    """Shuffle seed; the order of epoch e is a permutation seeded by (seed, e)."""
    shuffle: bool = True
    """False keeps file order (evaluation)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for ``path`` (e.g. ``{"endpoint_url": ...}`` for an S3-compatible store); credentials come
    from the environment."""

    def __post_init__(self) -> None:
        if not self.path:
            raise field_error(ConfigError, "data.path", self.path, "a file or directory", "point at your prompts")


def check_prompts_per_step(prompts_per_step: int, count: int, where: str) -> None:
    """Refuse a prompt set of fewer than ``prompts_per_step`` prompts: every step would draw a prompt twice.

    A step's prompts become its groups, whose ids (and so its sample ids) must be unique within the step.
    ``PromptDataset.batch`` never repeats a prompt within a step when ``count >= prompts_per_step``, also in
    a step spanning two epochs. ``where`` names the prompt set in the message (``data.prompts``,
    ``data.toy.num_prompts``, a file)."""
    n = prompts_per_step
    if count >= n:
        return
    raise field_error(ConfigError, "data.prompts_per_step", n,
                      f"at most the number of prompts ({count} in {where}): a step takes {n} distinct prompts, "
                      f"so with {count} every step would draw a prompt twice and its sample ids collide",
                      f"set data.prompts_per_step to at most {count}, or add prompts to {where}")


class PromptDataset:
    """Prompt records with a deterministic per-step sampler."""

    _MEMO_SIZE = 8  # effective epoch orders kept: a step needs at most two epochs, a walk back up to n

    def __init__(self, records: Sequence[PromptRecord], *, seed: int = 0, shuffle: bool = True) -> None:
        if not records:
            raise field_error(InvariantError, "records", 0, "at least one prompt", "check the data file")
        ids = [r.prompt_id for r in records]
        if len(set(ids)) != len(ids):
            raise field_error(InvariantError, "prompt_id", len(ids) - len(set(ids)), "unique prompt ids",
                              "set id_field to a unique column or leave it None")
        self.records = list(records)
        self.seed = seed
        self.shuffle = shuffle
        self._memo: dict[tuple[int, int], list[int]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_memo", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _memo={}, _lock=threading.Lock())

    def __len__(self) -> int:
        return len(self.records)

    def _order(self, epoch: int) -> list[int]:
        """The seeded shuffle of epoch ``epoch`` (file order when unshuffled)."""
        if not self.shuffle:
            return list(range(len(self.records)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=g).tolist()

    def epoch_order(self, epoch: int, n: int) -> list[int]:
        """Record indices in the order of epoch ``epoch`` of the stream that ``batch(., n)`` cuts into steps.

        Epoch ``e`` holds stream positions ``[e*size, (e+1)*size)``. Its order is its seeded shuffle
        (``_order``), except when a step spans the boundary from epoch ``e-1``: that step takes the last
        ``r = e*size % n`` prompts of epoch ``e-1`` as ordered here (``A``) and the first ``n - r`` of epoch
        ``e``. Epoch ``e`` then puts first the first ``n - r`` prompts of its shuffle not in ``A``, and keeps
        the rest in shuffle order. So that step draws no prompt twice (given ``size >= n``),
        every epoch is still a permutation of all prompts, and the order is the plain shuffle whenever the
        shuffle would not repeat a prompt - always when ``n`` divides ``size`` (no step spans two epochs).

        Only the first ``n`` positions of an epoch can move, so epoch ``e`` needs epoch ``e-1``'s reordered
        order only when ``A`` reaches into those (``size - r < n``); and an epoch starting on a step
        boundary (``e*size % n == 0``, every ``n / gcd(size, n)`` epochs) is its plain shuffle. Computing an
        epoch walks back at most that far, so any step (a resumed run's, a refill round's far down the
        stream) costs a few shuffles and is the same whichever steps were computed before.

        Fewer prompts than ``n``: plain shuffles (every step repeats prompts; the loop refuses that at load,
        ``check_prompts_per_step``). Unshuffled: file order, which never repeats a prompt within a step when
        ``size >= n`` (a step spanning a boundary takes the last ``r`` and the first ``n - r`` rows)."""
        size = len(self.records)
        if not self.shuffle or size < n or size % n == 0:
            return self._order(epoch)
        with self._lock:
            hit = self._memo.get((epoch, n))
        if hit is not None:
            return list(hit)
        start, prev = epoch, None
        while start > 0 and (r := start * size % n) and size - r < n:  # needs epoch start-1's reordered tail
            with self._lock:
                prev = self._memo.get((start - 1, n))
            if prev is not None:
                break
            start -= 1
        for e in range(start, epoch + 1):
            prev = self._reordered(e, n, prev)
        with self._lock:
            if len(self._memo) >= self._MEMO_SIZE:
                self._memo.pop(next(iter(self._memo)))
            self._memo[(epoch, n)] = prev
        return list(prev)

    def _reordered(self, epoch: int, n: int, prev: list[int] | None) -> list[int]:
        """Epoch ``epoch``'s order (``epoch_order``); ``prev``: epoch ``epoch-1``'s, or None where its plain
        shuffle has the same last ``epoch*size % n`` prompts."""
        order, size = self._order(epoch), len(self.records)
        r = epoch * size % n
        if epoch == 0 or r == 0:
            return order
        avoid = set((prev if prev is not None else self._order(epoch - 1))[size - r:])
        head, skipped, i = [], [], 0
        while len(head) < n - r:  # ends within the first n positions: at most r of them are in ``avoid``
            (skipped if order[i] in avoid else head).append(order[i])
            i += 1
        return head + skipped + order[i:]

    def batch(self, step: int, n: int) -> list[PromptRecord]:
        """The ``n`` prompts of step ``step``: positions ``[step * n, (step + 1) * n)`` of the epoch stream
        (``epoch_order``); distinct when ``len(self) >= n``."""
        if step < 0 or n < 1:
            raise field_error(InvariantError, "step/n", (step, n), "step >= 0 and n >= 1", "count steps from 0")
        out, size, orders = [], len(self.records), {}
        for k in range(step * n, (step + 1) * n):
            epoch, pos = divmod(k, size)
            if epoch not in orders:
                orders[epoch] = self.epoch_order(epoch, n)
            out.append(self.records[orders[epoch][pos]])
        return out


def where(cfg: PromptDataConfig, field: str = "data.file.path") -> Where:
    """``cfg``'s prompt set as ``unirl_core.data.uri`` reads it; errors name ``field``."""
    return Where(field, cfg.path, cfg.split, cfg.storage_options)


def check_columns(cfg: PromptDataConfig, rows: list[dict], section: str = "data.file") -> None:
    """Refuse rows without ``prompt_field`` (or ``answer_field``) as a ``ConfigError`` naming the field, the URI and
    the columns found (the preflight's check of the first rows)."""
    for name, value in (("prompt_field", cfg.prompt_field), ("answer_field", cfg.answer_field)):
        if value is None:
            continue
        for i, row in enumerate(rows):
            if value not in row or (name == "prompt_field" and not isinstance(row[value], str)):
                found = (f"row {i} has {type(row.get(value)).__name__} there" if value in row
                         else f"row {i} has columns {sorted(row)}")
                kind = "a string column" if name == "prompt_field" else "a column"
                fix = f"found: {found}; set {section}.{name} to one of them" + \
                    (" (or null)" if name == "answer_field" else "")
                raise field_error(ConfigError, f"{section}.{name}", value, f"{kind} of every row of {cfg.path}", fix)


def load_prompts(cfg: PromptDataConfig) -> PromptDataset:
    """Read ``cfg.path`` into a ``PromptDataset``; every row must carry the prompt (and answer) field."""
    records = []
    for i, row in enumerate(read_rows(where(cfg))):
        if not isinstance(row.get(cfg.prompt_field), str):
            raise field_error(InvariantError, f"{cfg.path}[{i}].{cfg.prompt_field}", row.get(cfg.prompt_field),
                              "a string prompt", f"fix the row or set prompt_field (columns: {sorted(row)})")
        targets = {}
        if cfg.answer_field is not None:
            if cfg.answer_field not in row:
                raise field_error(InvariantError, f"{cfg.path}[{i}].{cfg.answer_field}", None, "an answer column",
                                  f"set answer_field=None or to one of {sorted(row)}")
            targets["answer"] = str(row[cfg.answer_field])
        pid = str(row[cfg.id_field]) if cfg.id_field else str(i)
        records.append(PromptRecord(prompt_id=pid, prompt=row[cfg.prompt_field], targets=targets))
    logger.info("loaded %d prompts from %s", len(records), cfg.path)
    return PromptDataset(records, seed=cfg.seed, shuffle=cfg.shuffle)
