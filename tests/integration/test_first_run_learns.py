"""A first run that visibly learns: the tiny LM's accuracy on sums rises under GRPO on correctness after an SFT warm
start. It runs the shipped path (``run_local`` through ``benchmarks/first_run_climb.py``, one process per seed side
by side) with the recipes as shipped: ~1.5 min on 2 shared cores (SFT ~15 s, 200 GRPO steps ~60 s per seed).

The diffusion counterpart (the default recipe's reward climbing over two seeds by ``loop.climb``'s bar) is not here:
no shapes recipe met that bar on both seeds yet (unirl_core/algorithms/README.md, "The climb bar on shapes-sd3")."""

from __future__ import annotations

import pytest

from benchmarks.first_run_climb import measure, train_sft

pytestmark = pytest.mark.integration


def test_tiny_lm_accuracy_on_sums_rises(tmp_path):
    root = str(tmp_path)
    train_sft("sft-toy-sums", root)
    res = measure("toy-sums", [0, 1], root, metric="reward/toy_correct/mean",
                  overrides=[f"lm.model.model={root}/sft-toy-sums/export"])
    for seed, r in res["seeds"].items():
        a, b, c = r["stats"]["thirds"]
        # exact-match accuracy on the training sums: each third above the previous, the last at 1.5x the first
        assert a < b < c and c >= 1.5 * a, f"seed {seed}: {r['summary']}"
        held = [e["metrics"]["eval/reward/toy_correct/mean"] for e in r["evals"]]
        assert len(held) == 5  # step 0 and every 50 steps (the last is the end): the held-out accuracy is reported
