"""A compose run in the pool (``pool.execution: pool``) on a real local Ray cluster (2 CPUs): the composed rollout on
the engine actor, the reward on the reward actor, each stack on its own trainer actor, each stack's weights published
to the engine in-pool; the per-step numbers and both stacks' weights equal the in-process composed run's (fp32,
bitwise, same seeds)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.unit.compose.conftest import small_config
from unirl_core.checkpoint import CheckpointStore, load_weights
from unirl_core.compose.local import run_compose_local

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # this module's head too: loopback only
import ray  # noqa: E402  (the pool extra: a missing ray must fail, not skip)
from unirl_core.compose import pool as compose_pool  # noqa: E402

pytestmark = pytest.mark.integration
torch.set_num_threads(1)  # the actors compute with 1 thread (num_cpus 0.5): bitwise needs the same here
POOL = ["pool.execution=pool", "pool.engine.num_cpus=0.5", "pool.trainer.num_cpus=0.5"]
TEST_LIMIT_S = 400


@pytest.fixture(autouse=True)
def time_limit():
    """Each test is bounded: a hung actor call fails the test instead of the CI run."""
    def expire(signum, frame):
        raise TimeoutError(f"test ran past {TEST_LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_LIMIT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray head for the module; the compose pool attaches to it."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    compose_pool.close_compose_pool()
    ray.shutdown()


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


def test_a_frozen_stack_gets_no_trainer_actor(tmp_path):
    hist, _ = _run(tmp_path, "loop.total_steps=2", "image.frozen=true", *POOL)
    live = compose_pool.get_pool(small_config(tmp_path, "loop.total_steps=2", "image.frozen=true", *POOL)).live
    assert "image-trainer" not in live and "enhancer-trainer" in live
    assert "image/train/loss" not in hist[-1] and hist[-1]["pool/enhancer_trainer_restored"] == 0.0
