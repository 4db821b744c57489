"""A tiny DiffusionNFT run on CPU with deterministic ODE rollouts: the reward (mean image brightness, computed
inline) goes up on a fixed evaluation set (same x_T, ODE), as in test_flow_grpo_training.

v_old is the weights each step starts from (``old_policy: policy``), computed under no grad before the update;
one AdamW step per rollout batch. No SDE step is ever sampled: NFT needs only the clean samples.
"""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from unirl_core.algorithms.nft import DiffusionNFT, DiffusionNFTConfig
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig
from unirl_core.rollout.diffusion import DiffusionEngineConfig, TrainsideDiffusionEngine
from unirl_core.sde import flow_sigmas
from unirl_core.types import (
    DiffusionSamplingParams,
    NoiseRecipe,
    PromptRecord,
    SampleBatch,
)

torch.set_num_threads(1)
STEPS, ITERS = 6, 20


def _brightness(png: bytes) -> float:
    return float(np.asarray(Image.open(io.BytesIO(png))).astype(np.float32).mean() / 255)


def _group_advantages(batch: SampleBatch, rewards: np.ndarray) -> None:
    for idx in batch.groups().values():
        r = rewards[idx]
        for i, a in zip(idx, (r - r.mean()) / (r.std() + 1e-4)):
            batch.samples[i].generated.advantage = float(a)


@pytest.mark.slow
def test_tiny_nft_ode_run_increases_brightness():
    torch.manual_seed(0)
    bundle = DiffusionBundle.build(DiffusionModelConfig(finetune="full"))
    engine = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=8))
    algo = DiffusionNFT(DiffusionNFTConfig(old_policy="policy", beta=1.0))
    opt = torch.optim.AdamW([p for p in bundle.module.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=STEPS), guidance_scale=1.0, sde_type="ode")
    prompts = [PromptRecord(prompt_id=f"p{i}", prompt=f"a photo of thing {i}") for i in range(2)]
    eval_req = SampleBatch.from_prompts(prompts, samples_per_prompt=8, kind="diffusion", sampling=sp)

    def evaluate() -> np.ndarray:
        out = engine.generate(eval_req, noise=NoiseRecipe(base_seed=10_000))
        return np.array([_brightness(s.generated.media) for s in out])

    before = evaluate()
    for step in range(ITERS):
        req = SampleBatch.from_prompts([PromptRecord(prompt_id=f"s{step}-{p.prompt_id}", prompt=p.prompt)
                                        for p in prompts], samples_per_prompt=4, kind="diffusion", sampling=sp)
        batch = engine.generate(req, noise=NoiseRecipe(base_seed=step))
        _group_advantages(batch, np.array([_brightness(s.generated.media) for s in batch]))
        with torch.no_grad():
            v_old = algo.old_log_probs(bundle, batch)
        out = algo.loss(bundle, batch, old_log_probs=v_old)
        assert out.metrics["v_old_absdiff_max"] == 0.0
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    after = evaluate()
    spread = before.std()
    print("brightness before", before.mean(), "after", after.mean(), "spread", spread, "frac", (after > before).mean())
    assert after.mean() - before.mean() > 1.5 * spread, (before.mean(), after.mean(), spread)
    assert (after > before).mean() >= 0.75
