"""Token-budget micro-batches (``train.micro_batch_tokens``) keep the exactness contract on ragged LM batches.

The engine rescores over ``plan_micro_batches`` and the trainer replays over the same plan, so the first
update's ratio is exactly 1 and |logp_rollout - logp_replay| exactly 0 (fp32 and bf16). The loss and the
gradient equal the fixed-count path's within fp32 rounding: a micro-batch weighs its share of the loss's units
(samples for ``grpo``'s mean of sequence means and ``dr_grpo``'s constant normaliser, loss tokens for ``dapo``'s
token mean), so none of the three depends on packing.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from unirl_core.algorithms.grpo import GRPO, GRPOConfig
from unirl_core.errors import ConfigError
from unirl_core.models.lm import build_layout, build_tiny_lm
from unirl_core.models.micro_batch import plan_micro_batches, token_lengths
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.train.backend import TrainBackend
from unirl_core.train.config import TrainConfig
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch

REPO = Path(__file__).resolve().parents[3]
BUDGET = 96
PROMPTS = ["1+2=", "what is 17 plus 25? answer:", "9*9", "a much longer prompt about numbers: 3+4+5=",
           "x", "12-7 is"]


def ragged_batch(seed: int = 0, *, ragged_completions: bool = True) -> SampleBatch:
    """Prompts of 1..40 tokens; completions of 3..24 tokens (max_new_tokens varies per sample) or all 24."""
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=p) for i, p in enumerate(PROMPTS)]
    batch = SampleBatch.from_prompts(recs, samples_per_prompt=2, kind="ar",
                                     sampling=ARSamplingParams(max_new_tokens=24, temperature=1.0, seed=seed))
    for i, s in enumerate(batch):
        if ragged_completions:
            s.generated.sampling = dataclasses.replace(s.generated.sampling, max_new_tokens=3 + (7 * i) % 22)
    return batch


def rollout(dtype: str, *, engine_tokens, fbs: int = 4, decode: int | None = None, ragged_completions: bool = True):
    bundle = build_tiny_lm(seed=0, dtype=dtype, keep_reference=False)
    eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=fbs, apply_chat_template=False,
                                                   micro_batch_tokens=engine_tokens, decode_batch_size=decode))
    batch = eng.generate(ragged_batch(ragged_completions=ragged_completions))
    for k, p in enumerate(batch.generated):
        p.advantage = float((k % 5) - 2)
    return batch


def train(dtype: str, batch: SampleBatch, *, tokens, mb: int = 4, source: str = "rollout",
          algo: GRPOConfig | None = None, shard: str = "never"):
    """One backend step; returns the accumulated (pre-clip) gradient of every trainable tensor and the metrics."""
    backend = TrainBackend(build_tiny_lm(seed=0, dtype=dtype, keep_reference=False),
                           GRPO(algo or GRPOConfig(max_logp_absdiff=None)),
                           TrainConfig(lr=1e-3, micro_batch_size=mb, micro_batch_tokens=tokens,
                                       old_logp_source=source, shard=shard))
    grads: list[torch.Tensor] = []
    optimizer_step = backend._optimizer_step

    def capture() -> float:  # the gradient accumulated over every micro-batch, before clipping
        grads.extend(p.grad.detach().clone() for p in backend.params)
        return optimizer_step()

    backend._optimizer_step = capture
    return grads, backend.step(batch)


def test_ragged_batch_packs_into_unequal_micro_batches():
    batch = rollout("float32", engine_tokens=BUDGET)
    lengths = token_lengths([p.segment for p in batch.generated])
    assert len({r for _, r in lengths}) > 3 and len({p for p, _ in lengths}) > 3
    plan = plan_micro_batches(lengths, size=4, max_tokens=BUDGET)
    assert len({len(mb) for mb in plan}) > 1  # a real repack, not fixed slices in disguise
    assert sorted(i for mb in plan for i in mb) == list(range(len(batch)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_first_update_is_exact_with_token_budget(dtype):
    torch.set_num_threads(1)
    batch = rollout(dtype, engine_tokens=BUDGET)
    _, m = train(dtype, batch, tokens=BUDGET)
    assert m.metrics["ratio_min"] == m.metrics["ratio_max"] == 1.0
    assert m.metrics["logp_absdiff_max"] == 0.0
    assert m.grad_norm > 0


def test_mismatched_plans_are_not_exact_in_bf16():
    """The control: recording over fixed slices and replaying over token packs does change bf16 bits, so the
    exactness above comes from sharing the plan."""
    torch.set_num_threads(1)
    batch = rollout("bfloat16", engine_tokens=None, fbs=12)
    _, m = train("bfloat16", batch, tokens=BUDGET)
    assert m.metrics["logp_absdiff_max"] > 0.0


@pytest.mark.parametrize("agg", ["grpo", "dr_grpo", "dapo"])
def test_loss_and_gradient_match_fixed_count(agg):
    torch.set_num_threads(1)
    batch = rollout("float32", engine_tokens=None, fbs=4)
    algo = GRPOConfig(loss_agg=agg, max_response_tokens=24, max_logp_absdiff=None)
    fixed, m_fixed = train("float32", batch, tokens=None, mb=4, source="replay", algo=algo)
    packed, m_packed = train("float32", batch, tokens=BUDGET, source="replay", algo=algo)
    assert m_packed.metrics["ratio_min"] == m_packed.metrics["ratio_max"] == 1.0
    torch.testing.assert_close(m_packed.loss, m_fixed.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m_packed.grad_norm, m_fixed.grad_norm, rtol=1e-5, atol=1e-7)
    assert len(fixed) == len(packed) > 0
    for a, b in zip(fixed, packed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_wide_decode_keeps_rescoring_exact(monkeypatch):
    """Decoding all 12 rows at once, rescoring in slices of 4: still exact against a trainer at 4."""
    torch.set_num_threads(1)
    rows, rescored = [], []
    decode = TrainsideAREngine._decode
    monkeypatch.setattr(TrainsideAREngine, "_decode", lambda self, prompts, sp, gen: (
        rows.append(len(prompts)), decode(self, prompts, sp, gen))[1])
    monkeypatch.setattr("unirl_core.rollout.ar.build_layout", lambda segs, *a, **k: (
        rescored.append(len(segs)), build_layout(segs, *a, **k))[1])
    batch = rollout("bfloat16", engine_tokens=None, fbs=4, decode=12, ragged_completions=False)
    assert rows == [12] and rescored == [4, 4, 4]  # one decode batch, rescoring in the trainer's slices
    _, m = train("bfloat16", batch, tokens=None, mb=4)
    assert m.metrics["ratio_min"] == m.metrics["ratio_max"] == 1.0
    assert m.metrics["logp_absdiff_max"] == 0.0


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_bad_budgets_name_the_field(bad):
    with pytest.raises(ConfigError, match="train.micro_batch_tokens"):
        TrainConfig(micro_batch_tokens=bad)
    with pytest.raises(ConfigError, match="engine.micro_batch_tokens"):
        AREngineConfig(micro_batch_tokens=bad)
    with pytest.raises(ConfigError, match="engine.decode_batch_size"):
        AREngineConfig(decode_batch_size=bad)


WORKER = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from unirl_core.train import init_distributed
    from unirl_core.models.micro_batch import plan_micro_batches, token_lengths
    from tests.unit.train.test_token_budget import BUDGET, rollout, train

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    batch = rollout(sys.argv[2], engine_tokens=BUDGET)  # the same batch on both ranks (seeded)
    # rank 0's half holds the long completions, rank 1's the short ones: their packs differ in count
    order = sorted(range(len(batch)), key=lambda i: -batch.generated[i].segment.num_response_tokens)
    batch = batch.select(order)
    half = len(batch) // 2
    mine = batch[info.rank * half:(info.rank + 1) * half]
    own = len(plan_micro_batches(token_lengths([p.segment for p in mine.generated]), size=4, max_tokens=BUDGET))
    counts = [None, None]
    torch.distributed.all_gather_object(counts, own)
    _, m = train(sys.argv[2], batch, tokens=BUDGET, source="replay", shard="auto")
    if info.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps({**m.as_dict(), "own_counts": counts}))
    torch.distributed.destroy_process_group()
    import os
    os._exit(0)
""")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_fsdp_ranks_pack_to_the_same_count_and_stay_exact(dtype, tmp_path):
    """Each rank packs its own half; the rank with fewer packs splits its fullest until the counts match (else
    FSDP2 would hang); pi_old replayed over those micro-batches gives ratio exactly 1."""
    script, out = tmp_path / "worker.py", tmp_path / "metrics.json"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(out), dtype]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = json.loads(out.read_text())
    assert m["own_counts"][0] != m["own_counts"][1]  # the ranks' own plans differ in count: one was split
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["grad_norm"] > 0



def test_dapo_batch_loss_is_the_token_mean_over_the_whole_batch():
    """DAPO's token mean (sum of per-token losses / number of loss tokens, over the batch): micro-batches of
    different token counts weigh by their tokens, so the backend's batch loss equals one micro-batch of all."""
    torch.set_num_threads(1)
    batch = rollout("float32", engine_tokens=None, fbs=4)
    algo = GRPOConfig(loss_agg="dapo", max_logp_absdiff=None)
    _, split = train("float32", batch, tokens=None, mb=3, source="replay", algo=algo)
    _, whole = train("float32", batch, tokens=None, mb=len(batch), source="replay", algo=algo)
    torch.testing.assert_close(split.loss, whole.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(split.grad_norm, whole.grad_norm, rtol=1e-5, atol=1e-7)
