"""Write GSM8K (hub dataset ``openai/gsm8k``, config ``main``) as ``qwen3-math``'s prompt file: jsonl rows
``{"question": ..., "answer": <final value>}``, the format of ``data/math/train.jsonl``.

    python scripts/prepare_gsm8k.py data/math/train.jsonl            # the train split (7,473 rows)
    python scripts/prepare_gsm8k.py s3://<bucket>/prompts/gsm8k-test.jsonl --split test

GSM8K's ``answer`` is a worked solution ending in ``#### <value>``; the row keeps the value (thousands separators
dropped), which is what math-verify compares the completion's boxed answer to. Needs ``datasets`` (the ``lm`` extra)
and the hub (``HF_TOKEN`` is not needed: the dataset is public). Writes through fsspec, so the output may be any URL.
"""

from __future__ import annotations

import argparse
import json

import fsspec

DATASET, CONFIG = "openai/gsm8k", "main"
MARK = "####"


def convert_row(row: dict) -> dict:
    """One GSM8K row -> ``{"question", "answer"}`` with the final value only."""
    solution = row["answer"]
    if MARK not in solution:
        raise ValueError(f"a GSM8K answer ends in '{MARK} <value>'; got {solution[-80:]!r}")
    value = solution.rsplit(MARK, 1)[1].strip().replace(",", "")
    return {"question": row["question"].strip(), "answer": value}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the jsonl to write (local path or fsspec URL)")
    ap.add_argument("--split", default="train", choices=["train", "test"])
    args = ap.parse_args(argv)
    from datasets import load_dataset

    rows = [convert_row(r) for r in load_dataset(DATASET, CONFIG, split=args.split)]
    with fsspec.open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} rows of {DATASET} ({CONFIG}, {args.split}) -> {args.out}")


if __name__ == "__main__":
    main()
