"""A compose run in the pool (``pool.execution: pool``) on a real local Ray cluster (2 CPUs): the composed rollout on
the engine actor, the reward on the reward actor, each stack on its own trainer actor, each stack's weights published
to the engine in-pool; the per-step numbers and both stacks' weights equal the in-process composed run's (fp32,
bitwise, same seeds)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.pool_support import local_ray_fixture, time_limit_fixture
from tests.unit.compose.conftest import small_config, small_overrides
from unirl_core.checkpoint import CheckpointStore, load_weights
from unirl_core.compose import pool as compose_pool
from unirl_core.compose.local import run_compose_local
from workflows.enhance import enhance

pytestmark = pytest.mark.integration
torch.set_num_threads(1)  # the actors compute with 1 thread (num_cpus 0.5): bitwise needs the same here
POOL = ["pool.execution=pool", "pool.engine.num_cpus=0.5", "pool.trainer.num_cpus=0.5"]
time_limit = time_limit_fixture(400)
local_ray = local_ray_fixture(close=compose_pool.close_compose_pool)


def _run(root, *extra):
    batches = []
    hist = run_compose_local(small_config(root, *extra), progress=False, on_step=lambda m, b: batches.append(b))
    return hist, batches


def _per_sample(batch):
    return [(s.sample_id, p.reward, p.advantage, p.text, tuple(p.segment.log_probs.tolist()))
            for s in batch for p in s.parts]


def _weights(root, stack, step):
    return load_weights([v for v in CheckpointStore(f"{root}/enh", stack).versions() if v.step == step][0])


def test_composed_pool_run_equals_the_in_process_run_bitwise(tmp_path):
    steps = 3
    local, local_batches = _run(tmp_path / "local", f"loop.total_steps={steps}")
    pool, pool_batches = _run(tmp_path / "pool", f"loop.total_steps={steps}", *POOL)
    keys = ["reward/mean", "enhancer/reward/mean", "enhancer/train/loss", "image/train/loss",
            "enhancer/train/ratio_mean", "image/train/ratio_mean", "enhancer/train/grad_norm", "image/train/grad_norm"]
    assert [[h[k] for k in keys] for h in pool] == [[h[k] for k in keys] for h in local]
    assert [_per_sample(b) for b in pool_batches] == [_per_sample(b) for b in local_batches]
    for stack in ("enhancer", "image"):
        assert pool[0][f"{stack}/train/ratio_mean"] == 1.0  # exact ratio 1 on both Parts' first update, in the pool
        a, b = _weights(tmp_path / "pool", stack, steps), _weights(tmp_path / "local", stack, steps)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        # the trainer restores only for its first step; afterwards its optimizer state stays resident
        assert [h[f"pool/{stack}_trainer_restored"] for h in pool] == [1.0] + [0.0] * (steps - 1)
    # both stacks come from the store once (step 1); later versions reach the engine in-pool
    assert [h["pool/stacks_loaded_from_store"] for h in pool] == [2.0] + [0.0] * (steps - 1)


def test_a_frozen_stack_gets_no_trainer_actor_and_the_enhancer_trainer_keeps_its_warm_started_reference(tmp_path):
    kl = ["enhancer.lm.algorithm.beta=0.1", "enhancer.lm.model.keep_reference=true"]
    hist, _ = _run(tmp_path, "loop.total_steps=2", "image.frozen=true", *kl, *POOL)
    cfg = small_config(tmp_path, "loop.total_steps=2", "image.frozen=true", *kl, *POOL)
    live = compose_pool.ComposePool.get(cfg).live
    assert "image-trainer" not in live and "enhancer-trainer" in live
    assert "image/train/loss" not in hist[-1] and hist[-1]["pool/enhancer_trainer_restored"] == 0.0
    # the trainer actor's KL reference is the warm-started step-0 version (not the random init): 0 at step 1
    assert hist[0]["enhancer/train/kl"] == 0.0 and hist[1]["enhancer/train/kl"] > 0.0


def test_the_flyte_workflow_in_pool_mode_equals_pods(tmp_path):
    """``workflows/enhance.py`` executed locally by flytekit: its tasks dispatch to the compose pool unchanged."""
    numbers = {}
    for mode, extra in (("pods", []), ("pool", POOL)):
        out = enhance(recipe="shapes-enhance", overrides=small_overrides(
            tmp_path / mode, "loop.steps_per_chunk=1", "eval=null", *extra, name="flow"))
        assert (out.enhancer.step, out.image.step) == (2, 2)
        lines = [r["metrics"] for r in json.loads((tmp_path / mode / "flow" / "report" / "steps.json").read_text())]
        numbers[mode] = [(h["reward/mean"], h["enhancer/train/loss"], h["image/train/loss"]) for h in lines]
    assert numbers["pool"] == numbers["pods"]
