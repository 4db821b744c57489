"""SFT records and the supervised Parts they become.

A record is ``(caption, image uint8 [H, W, 3])`` for diffusion or ``(prompt, completion)`` for LMs. Step k's
records are positions ``[(k-1) * B, k * B)`` of a stream of per-epoch permutations seeded by
``(data.seed, epoch)``, so any step is recomputable after a resume without a stored cursor.

Supervised Parts use the ordinary typed boundary: a diffusion Part carries the caption as ``prompt`` and the
image as ``conditions['target_image']`` (uint8 ``[3, H, W]``); an AR Part carries a ``TokenSegment`` whose
response is the completion (+ EOS), with zero log-probs (never read) and a full response mask.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from unirl_core.errors import ConfigError, InvariantError, field_error
from unirl_core.rollout.agentic import conversation_segment
from unirl_core.sft.config import SFTConfig
from unirl_core.sft.sources import record_source
from unirl_core.sft.losses import TARGET_IMAGE
from unirl_core.types import Part, Sample, SampleBatch, TokenSegment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageRecord:
    caption: str
    image: np.ndarray
    """uint8 ``[H, W, 3]``."""


@dataclass(frozen=True)
class TextRecord:
    prompt: str
    completion: str
    turns: tuple[tuple[str, str], ...] | None = None
    """Multi-turn record: ``(role, text)`` with role ``assistant`` or ``env``; ``completion`` is then the joined text."""


Record = ImageRecord | TextRecord


def _read_png(path: Path, where: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError) as e:
        raise field_error(ConfigError, where, str(path), "a readable image file", f"fix the path ({e})") from e


def read_jsonl(cfg: SFTConfig) -> list[Record]:
    """Rows of ``data.path``: ``caption`` + ``image`` (a path relative to the file) or ``prompt`` + ``completion``
    (or ``turns``, see ``_text_record``)."""
    path = Path(cfg.data.path)
    if path.suffix != ".jsonl" or not path.is_file():
        raise field_error(ConfigError, "data.path", cfg.data.path, "an existing .jsonl file",
                          "write one JSON object per line and point data.path at it")
    out: list[Record] = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path}:{i + 1}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise field_error(ConfigError, where, line[:80], "a JSON object", str(e)) from e
            out.append(_text_record(row, where) if cfg.family == "lm" else _image_record(row, where, path.parent))
    if not out:
        raise field_error(ConfigError, "data.path", cfg.data.path, "at least one record", "the file is empty")
    return out


def _image_record(row: dict, where: str, folder: Path) -> ImageRecord:
    keys = ("caption", "image")
    missing = [k for k in keys if not isinstance(row.get(k), str)]
    if missing:
        raise field_error(ConfigError, f"{where}.{missing[0]}", row.get(missing[0]), "a string",
                          f"family='diffusion' rows need {keys} (found {sorted(row)})")
    return ImageRecord(row["caption"], _read_png(folder / row["image"], f"{where}.image"))


def _text_record(row: dict, where: str) -> TextRecord:
    """An LM row: ``prompt`` + ``completion``, or ``prompt`` + ``turns`` (a list of ``{"role": "assistant" | "env",
    "content": str}``: an agentic conversation, trained on the assistant turns only)."""
    if not isinstance(row.get("prompt"), str):
        raise field_error(ConfigError, f"{where}.prompt", row.get("prompt"), "a string",
                          f"LM rows need prompt and completion (or turns); found {sorted(row)}")
    if "turns" in row:
        turns = row["turns"]
        ok = isinstance(turns, list) and turns and all(
            isinstance(t, dict) and t.get("role") in ("assistant", "env") and isinstance(t.get("content"), str)
            for t in turns)
        if not ok:
            raise field_error(ConfigError, f"{where}.turns", turns, "a non-empty list of {role: assistant|env, "
                              "content: str}", "write each turn as an object with role and content")
        pairs = tuple((t["role"], t["content"]) for t in turns)
        return TextRecord(row["prompt"], "\n".join(c for _, c in pairs), turns=pairs)
    if not isinstance(row.get("completion"), str):
        raise field_error(ConfigError, f"{where}.completion", row.get("completion"), "a string",
                          f"LM rows need prompt and completion (or turns); found {sorted(row)}")
    return TextRecord(row["prompt"], row["completion"])


def toy_records(cfg: SFTConfig) -> list[Record]:
    """The toy arithmetic prompts (``data.toy``), each with its answer as the completion."""
    from unirl_core.data.toy import toy_arithmetic_prompts

    return [TextRecord(r.prompt, r.targets["answer"]) for r in toy_arithmetic_prompts(cfg.data.section("toy"))]


def load_records(cfg: SFTConfig) -> list[Record]:
    """All records of the run, checked against the model section (image size)."""
    if cfg.data.source == "jsonl":
        records = read_jsonl(cfg)
    else:
        records = record_source(cfg.data.source).records(cfg)
    if cfg.family == "diffusion":
        want = (cfg.diffusion.height, cfg.diffusion.width, 3)
        for i, r in enumerate(records):
            if tuple(r.image.shape) != want:
                raise field_error(ConfigError, f"record[{i}].image", tuple(r.image.shape), f"shape {want}",
                                  "resize the images or set diffusion.height/width to their size")
    log.info("SFT records: %d (%s)", len(records), cfg.data.source)
    return records


def step_indices(num_records: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Record indices of step ``step`` (1-based): a stream of per-epoch permutations seeded by (seed, epoch)."""
    if step < 1:
        raise field_error(InvariantError, "step", step, "an integer >= 1", "SFT steps count from 1")
    out, orders = [], {}
    for k in range((step - 1) * batch_size, step * batch_size):
        epoch, pos = divmod(k, num_records)
        if epoch not in orders:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            orders[epoch] = torch.randperm(num_records, generator=g).tolist()
        out.append(orders[epoch][pos])
    return out


def supervised_batch(cfg: SFTConfig, records: list[Record], step: int, *, policy_version: int,
                     encode_prompt=None, eos_id: int | None = None, tokenizer=None) -> SampleBatch:
    """Step ``step``'s records as supervised Parts. LM batches need ``encode_prompt`` (prompt -> ids, the RL
    engine's format), the ``tokenizer`` for completions and the ``eos_id`` appended to each completion."""
    idx = step_indices(len(records), cfg.data.batch_size, step, cfg.data.seed)
    samples = []
    for j, i in enumerate(idx):
        sid, gid = f"step{step}/{j}", f"record{i}"
        rec = records[i]
        if isinstance(rec, ImageRecord):
            image = torch.from_numpy(np.array(rec.image, dtype=np.uint8)).permute(2, 0, 1).contiguous()
            part = Part(kind="diffusion", sample_id=sid, group_id=gid, prompt=rec.caption,
                        conditions={TARGET_IMAGE: image}, policy_version=policy_version)
        else:
            part = Part(kind="ar", sample_id=sid, group_id=gid, prompt=rec.prompt, text=rec.completion,
                        segment=_token_segment(cfg, rec, encode_prompt, tokenizer, eos_id),
                        policy_version=policy_version)
        samples.append(Sample(sample_id=sid, group_id=gid, parts=[part]))
    return SampleBatch(samples=samples, metadata={"run": cfg.name, "step": str(step), "sft": "1"})


def _token_segment(cfg: SFTConfig, rec: TextRecord, encode_prompt, tokenizer, eos_id: int | None) -> TokenSegment:
    prompt_ids = encode_prompt(rec.prompt)
    if rec.turns is not None:
        return conversation_segment(prompt_ids, rec.turns, tokenizer=tokenizer, eos_id=eos_id,
                                    observation_template=cfg.lm.prompt.observation_template,
                                    max_tokens=cfg.lm.max_completion_tokens)
    return completion_segment(prompt_ids, rec.completion, tokenizer, eos_id, cfg.lm.max_completion_tokens)


def completion_segment(prompt_ids, completion: str, tokenizer, eos_id: int | None,
                       max_tokens: int | None = None) -> TokenSegment:
    """A supervised segment: ``prompt_ids`` -> the completion's tokens + ``eos_id`` (cut at ``max_tokens``: finish
    ``length``), with zero log-probs (never read) and a full response mask."""
    ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + ([eos_id] if eos_id is not None else [])
    finish = "stop" if max_tokens is None or len(ids) <= max_tokens else "length"
    ids = ids[:max_tokens]
    if not ids:
        raise field_error(ConfigError, "record.completion", completion, "a completion of >= 1 token",
                          "drop empty completions from the data")
    r = len(ids)
    return TokenSegment(prompt_ids=prompt_ids, response_ids=torch.tensor(ids, dtype=torch.int64),
                        log_probs=torch.zeros(r, dtype=torch.float32), response_mask=torch.ones(r, dtype=torch.bool),
                        finish_reason=finish)
