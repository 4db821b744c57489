"""GRPO over the tiny LM: exact first-update ratio, replay source, fail-closed check, KL, a tiny run."""

import pytest
import torch

from unirl_core.algorithms.base import Algorithm, Policy
from unirl_core.algorithms.grpo import GRPO, GRPOConfig
from unirl_core.data import PromptDataset, toy_arithmetic_prompts, toy_arithmetic_reward
from unirl_core.errors import InvariantError, NumericsError
from unirl_core.models.lm import build_tiny_lm
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.types import ARSamplingParams, SampleBatch


def _rollout(bundle, *, fbs=4, logp_source="rescore", n_prompts=3, k=4, max_new_tokens=10, seed=0):
    eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=fbs, logp_source=logp_source))
    sp = ARSamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, seed=seed)
    out = eng.generate(SampleBatch.from_prompts(toy_arithmetic_prompts()[:n_prompts], samples_per_prompt=k,
                                                kind="ar", sampling=sp))
    for i, s in enumerate(out.samples):
        s.generated.advantage = float(i % 3) - 1.0
    return out


def _loss_metrics(alg, bundle, batch, mbs, *, replay=False):
    bundle.module.train()  # the trainer's mode; dropout is 0 so it must not change the bits
    out = []
    for mb in batch.split(mbs):
        old = alg.old_log_probs(bundle, mb) if replay else None
        out.append(alg.loss(bundle, mb, old_log_probs=old).metrics)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_first_update_ratio_is_exactly_one(dtype, finetune):
    bundle = build_tiny_lm(seed=0, dtype=dtype, finetune=finetune, lora_rank=4)
    alg = GRPO(GRPOConfig(max_logp_absdiff=0.0))
    assert isinstance(alg, Algorithm) and isinstance(bundle, Policy)
    batch = _rollout(bundle, fbs=4)
    for m in _loss_metrics(alg, bundle, batch, 4):
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["ratio_mean"] == 1.0
        assert m["logp_absdiff_max"] == 0.0 and m["logp_absdiff_mean"] == 0.0 and m["clip_frac"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_source_restores_exactness_for_foreign_log_probs(dtype):
    # Decode-time (KV-cache) log-probs are not bit-identical to a full forward: the rollout source
    # then shows ratio != 1; replaying pi_old over the training micro-batches gives exactly 1 again,
    # also with micro-batches (3) that differ from the rollout's forward batches (4).
    bundle = build_tiny_lm(seed=0, dtype=dtype, keep_reference=False)
    batch = _rollout(bundle, fbs=4, logp_source="decode")
    alg = GRPO(GRPOConfig(max_logp_absdiff=0.5))
    stored = _loss_metrics(alg, bundle, batch, 3)
    assert max(m["logp_absdiff_max"] for m in stored) > 0
    assert max(abs(m["ratio_max"] - 1) + abs(m["ratio_min"] - 1) for m in stored) > 0
    for m in _loss_metrics(alg, bundle, batch, 3, replay=True):
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0
        assert 0 < m["logp_absdiff_max"] < (1e-5 if dtype == "float32" else 0.1)  # the measured drift


def test_fail_closed_on_rollout_replay_mismatch():
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    batch = _rollout(bundle, logp_source="decode")
    with pytest.raises(NumericsError, match="logp_absdiff_max"):
        GRPO(GRPOConfig(max_logp_absdiff=0.0)).old_log_probs(bundle, batch.split(4)[0])
    tampered = _rollout(bundle)
    seg = tampered.samples[0].generated.segment
    seg.log_probs = seg.log_probs - 2.0
    with pytest.raises(NumericsError):
        GRPO(GRPOConfig(max_logp_absdiff=1.0)).old_log_probs(bundle, tampered.split(4)[0])


def test_missing_advantage_is_an_error():
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    batch = _rollout(bundle)
    batch.samples[1].generated.advantage = None
    with pytest.raises(InvariantError, match="advantage"):
        GRPO().loss(bundle, batch, old_log_probs=None)


def test_kl_to_reference_is_zero_before_and_positive_after_an_update():
    bundle = build_tiny_lm(seed=0, finetune="lora", lora_rank=4)
    batch = _rollout(bundle)
    alg = GRPO(GRPOConfig(beta=0.1, kl_estimator="k3"))
    assert _loss_metrics(alg, bundle, batch, 12)[0]["kl"] == 0.0
    opt = torch.optim.SGD([p for p in bundle.module.parameters() if p.requires_grad], lr=0.5)
    alg.loss(bundle, batch, old_log_probs=None).loss.backward()
    opt.step()
    m = _loss_metrics(alg, bundle, batch, 12)[0]
    assert m["kl"] > 0 and m["ratio_max"] != 1.0


@pytest.mark.slow
def test_tiny_grpo_run_raises_mean_reward():
    torch.manual_seed(0)
    bundle = build_tiny_lm(seed=0, keep_reference=False)
    eng = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=32))
    alg = GRPO(GRPOConfig(loss_agg="grpo"))
    data = PromptDataset(toy_arithmetic_prompts(), seed=0)
    opt = torch.optim.AdamW(bundle.module.parameters(), lr=3e-3, weight_decay=0.0)
    sp = ARSamplingParams(max_new_tokens=4, seed=None)
    means = []
    for step in range(30):
        out = eng.generate(SampleBatch.from_prompts(data.batch(step, 8), samples_per_prompt=8, kind="ar", sampling=sp))
        for idx in out.groups().values():
            parts = [out.samples[i].generated for i in idx]
            r = torch.tensor([toy_arithmetic_reward(p.text, p.targets["answer"]) for p in parts])
            adv = (r - r.mean()) / (r.std(correction=0) + 1e-4)
            for p, rv, a in zip(parts, r.tolist(), adv.tolist()):
                p.reward, p.advantage = rv, a
        means.append(sum(s.generated.reward for s in out) / len(out))
        bundle.module.train()
        opt.zero_grad()
        for mb in out.split(32):
            m = alg.loss(bundle, mb, old_log_probs=None)
            assert m.metrics["ratio_min"] == 1.0 == m.metrics["ratio_max"]
            (m.loss / 2).backward()
        opt.step()
    first, last = sum(means[:5]) / 5, sum(means[-5:]) / 5
    assert first < 0.1 and last > first + 0.25, means
