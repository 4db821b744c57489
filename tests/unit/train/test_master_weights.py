"""``train.master_weights``: fp32 masters (default) or the weights and AdamW state in the model dtype (TRL's
bf16 footprint). The forward is the same either way, so the first update stays exact."""

import pytest
import torch

from unirl_core.algorithms.grpo import GRPO, GRPOConfig
from unirl_core.errors import ConfigError
from unirl_core.models.lm import build_tiny_lm
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.train.backend import TrainBackend
from unirl_core.train.config import TrainConfig
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


def _batch():
    bundle = build_tiny_lm(seed=0, dtype="bfloat16", keep_reference=False)
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=p) for i, p in enumerate(["1+2=", "9*9 is", "x"])]
    req = SampleBatch.from_prompts(recs, samples_per_prompt=4, kind="ar",
                                   sampling=ARSamplingParams(max_new_tokens=8, temperature=1.0, seed=0))
    batch = TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=4, apply_chat_template=False)).generate(req)
    for k, p in enumerate(batch.generated):
        p.advantage = float((k % 3) - 1)
    return batch


def _state_bytes(backend: TrainBackend) -> int:
    params = sum(p.numel() * p.element_size() for p in backend.params)
    state = sum(t.numel() * t.element_size() for s in backend.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return params + state


@pytest.mark.parametrize("master", ["fp32", "model"])
def test_first_update_exact_and_state_dtype(master):
    torch.set_num_threads(1)
    batch = _batch()
    backend = TrainBackend(build_tiny_lm(seed=0, dtype="bfloat16", keep_reference=False),
                           GRPO(GRPOConfig(max_logp_absdiff=None)),
                           TrainConfig(lr=1e-3, micro_batch_size=4, master_weights=master))
    want = torch.float32 if master == "fp32" else torch.bfloat16
    assert {p.dtype for p in backend.params} == {want}
    before = [p.detach().clone() for p in backend.params]
    m = backend.step(batch)
    assert m.metrics["ratio_min"] == m.metrics["ratio_max"] == 1.0 and m.metrics["logp_absdiff_max"] == 0.0
    states = [t for s in backend.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    assert states and {t.dtype for t in states} == {want}
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, backend.params))  # it trained


def test_model_dtype_masters_halve_weights_and_optimizer_state():
    torch.set_num_threads(1)
    batch = _batch()
    sizes = {}
    for master in ("fp32", "model"):
        backend = TrainBackend(build_tiny_lm(seed=0, dtype="bfloat16", keep_reference=False),
                               GRPO(GRPOConfig(max_logp_absdiff=None)),
                               TrainConfig(lr=1e-3, micro_batch_size=4, master_weights=master))
        backend.step(batch)
        sizes[master] = _state_bytes(backend)
    assert sizes["model"] * 2 == sizes["fp32"]


def test_bad_master_weights_names_the_field():
    with pytest.raises(ConfigError, match=r"^train\.master_weights='fp16'"):
        TrainConfig(master_weights="fp16")
