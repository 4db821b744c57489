"""Evaluations cached by content: the same weights under the same protocol are evaluated once per checkpoint root
(whichever run or step holds them: a fork's start version is its parent's), a changed protocol recomputes, and every
eval record names the weights and protocol digests it measured."""

from __future__ import annotations

import json

import pytest
import torch

from unirl_core.checkpoint import CheckpointStore, load_manifest
from unirl_core.config import load_recipe
from unirl_core.io.diff import same_bits
from unirl_core.loop import evaluate
from unirl_core.loop.eval_cache import EVAL_CACHE_DIR
from unirl_core.loop.evaluate import eval_phase
from unirl_core.loop.local import run_local
from unirl_core.report.run_report import RunReport

torch.set_num_threads(1)

SMALL = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
         "lm.engine.forward_batch_size=8", "report.tensorboard=false", "eval.num_prompts=3",
         "checkpoint.keep_every=1"]


def _cfg(root, *extra: str):
    return load_recipe("tiny-grpo", [*SMALL, f"checkpoint.root={root}", "loop.total_steps=2", *extra])


@pytest.fixture
def computed(monkeypatch):
    """The evaluations actually sampled and scored (a counter around the eval's compute)."""
    calls: list[int] = []
    compute = evaluate._sample_and_score

    def counted(cfg, ckpt, *a, **kw):
        calls.append(ckpt.step)
        return compute(cfg, ckpt, *a, **kw)

    monkeypatch.setattr(evaluate, "_sample_and_score", counted)
    return calls


def _timeless(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith("seconds")}


def test_same_version_is_evaluated_once_and_a_changed_protocol_recomputes(tmp_path, computed):
    cfg = _cfg(tmp_path)
    hist = run_local(cfg, progress=False)
    assert computed == [0, 2]  # the start and the end of the run
    latest = CheckpointStore(str(tmp_path), cfg.name).latest()
    batch, metrics = eval_phase(cfg, latest)
    assert computed == [0, 2]  # read back, not sampled again
    assert _timeless(metrics) == _timeless({k: v for k, v in hist[-1].items() if k.startswith("eval/")})
    assert metrics["eval/sample_seconds"] == 0.0 and batch.metadata["eval_cached"]
    sha = load_manifest(latest).weights_sha256("model.safetensors")
    assert batch.metadata["weights_sha256"] == sha
    fresh, fresh_metrics = eval_phase(cfg, latest, use_cache=False)  # what the cache returned is what it computes
    assert computed == [0, 2, 2] and _timeless(fresh_metrics) == _timeless(metrics)
    assert all(same_bits(a.segment.response_ids, b.segment.response_ids)
               for a, b in zip(fresh.generated, batch.generated))
    for changed in ("eval.samples_per_prompt=2", "eval.num_prompts=2",
                    'reward.components=[{"name": "toy_arithmetic", "weight": -1.0}]'):
        eval_phase(_cfg(tmp_path, changed), latest)
    assert computed == [0, 2, 2, 2, 2, 2]
    eval_phase(_cfg(tmp_path, "eval.num_prompts=2"), latest)  # that protocol is cached now too
    assert computed == [0, 2, 2, 2, 2, 2]
    # the record of each entry: the numbers beside the digests they measured
    records = [json.loads(p.read_text()) for p in (tmp_path / EVAL_CACHE_DIR).glob("*.json")]
    assert len(records) == 5 and all(len(r["weights_sha256"]) == len(r["protocol_sha256"]) == 64 for r in records)
    assert any(r["weights_sha256"] == sha and r["metrics"]["eval/reward/mean"] == metrics["eval/reward/mean"]
               for r in records)
    # and the run report's eval records name them
    evals = RunReport(str(tmp_path / cfg.name)).evals()
    assert [rec.digests["weights_sha256"] == sha for rec, _ in evals] == [False, True]


def test_a_forks_start_version_is_its_parents_evaluation(tmp_path, computed):
    run_local(_cfg(tmp_path, "eval.every_n_steps=1"), progress=False)
    # step 1's rewards are all 0 on this seed: no update, the weights of version 1 are version 0's (a cache hit)
    digest = {s: load_manifest(CheckpointStore(str(tmp_path), "tiny-grpo").ref_for(s, s)).weights_sha256(
        "model.safetensors") for s in (0, 1, 2)}
    assert digest[0] == digest[1] != digest[2] and computed == [0, 2]
    fork = _cfg(tmp_path, "eval.every_n_steps=1", "name=fork", "checkpoint.fork_from=tiny-grpo@1",
                "loop.total_steps=3")
    run_local(fork, progress=False)
    # the fork's step 2 is the parent's version 2 bit for bit (no overrides): only its step 3 is evaluated
    assert computed == [0, 2, 3]
    start = CheckpointStore(str(tmp_path), "fork").ref_for(1, 1)
    batch, metrics = eval_phase(fork, start)  # the shared prefix: the parent's evaluation
    assert computed == [0, 2, 3] and metrics["eval/step"] == 1.0 and batch.metadata["weights_sha256"] == digest[1]
