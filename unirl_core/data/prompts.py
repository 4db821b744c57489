"""Prompt data sets: records from jsonl, parquet or a local HF ``datasets`` directory.

A ``PromptDataset`` is an immutable list of ``PromptRecord`` plus a deterministic sampler:
``batch(step, n)`` returns the prompts of optimizer step ``step``. The order is a permutation
per epoch seeded by ``(seed, epoch)``, so any step can be recomputed after a resume without
replaying the steps before it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from unirl_core.errors import ConfigError, InvariantError, field_error
from unirl_core.types import PromptRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PromptDataConfig:
    """Where prompts come from and which fields they use."""

    path: str
    """A ``.jsonl`` / ``.parquet`` file, or a directory written by ``datasets.Dataset.save_to_disk``."""
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

    def __post_init__(self) -> None:
        if not self.path:
            raise field_error(ConfigError, "data.path", self.path, "a file or directory", "point at your prompts")


class PromptDataset:
    """Prompt records with a deterministic per-step sampler."""

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

    def __len__(self) -> int:
        return len(self.records)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=g).tolist()

    def batch(self, step: int, n: int) -> list[PromptRecord]:
        """The ``n`` prompts of step ``step``: positions ``[step * n, (step + 1) * n)`` of the epoch stream."""
        if step < 0 or n < 1:
            raise field_error(InvariantError, "step/n", (step, n), "step >= 0 and n >= 1", "count steps from 0")
        out, size = [], len(self.records)
        for k in range(step * n, (step + 1) * n):
            epoch, pos = divmod(k, size)
            out.append(self.records[self._order(epoch)[pos]])
        return out


def _rows(cfg: PromptDataConfig) -> list[dict]:
    path = Path(cfg.path)
    if path.is_dir():
        try:
            import datasets
        except ModuleNotFoundError as e:
            raise field_error(ConfigError, "data.path", cfg.path, "the datasets package for a saved HF dataset",
                              "pip install datasets, or export the prompts to jsonl/parquet") from e
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise field_error(ConfigError, "data.split", cfg.split, f"one of {sorted(ds)}", "name a split")
            ds = ds[cfg.split]
        return [dict(r) for r in ds]
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise field_error(ConfigError, "data.path", cfg.path, "a .jsonl or .parquet file or a saved HF dataset dir",
                      "convert the prompts to one of these formats")


def load_prompts(cfg: PromptDataConfig) -> PromptDataset:
    """Read ``cfg.path`` into a ``PromptDataset``; every row must carry the prompt (and answer) field."""
    records = []
    for i, row in enumerate(_rows(cfg)):
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
