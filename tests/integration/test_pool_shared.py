"""``pool.placement: shared`` on a real local Ray cluster (2 CPUs): one actor process hosts the trainer and the
trainside engine, which samples with the trainer's own module (no second copy of the weights, a publish moves
no bytes). The per-step rewards and the written versions equal the in-process loop's bitwise (fp32), EMA rollouts
included; a killed shared actor fails the phase typed, naming it, and the retry resumes bit-exactly."""

from __future__ import annotations

import os
import signal
import time

import pytest
import safetensors.torch
import torch

from tests.flyte.conftest import SMALL, tiny_overrides
from tests.integration.pool_support import local_ray_fixture, time_limit_fixture
from unirl_core.checkpoint import CheckpointStore
from unirl_core.config import load_recipe
from unirl_core.errors import PoolActorDied
from unirl_core.loop import phases
from unirl_core.loop.local import run_local
from unirl_core.pool import cluster

pytestmark = pytest.mark.integration
SHARED = ["pool.execution=pool", "pool.placement=shared"]
TEST_LIMIT_S = 240
NFT = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=4",
       "diffusion.engine.forward_batch_size=4", "diffusion.sampling.num_steps=4", "eval=null"]


time_limit = time_limit_fixture(TEST_LIMIT_S)
local_ray = local_ray_fixture()


def _cfg(recipe: str, root, steps: int, *extra: str):
    small = NFT if recipe == "tiny-nft" else SMALL[recipe]
    return load_recipe(recipe, [*small, f"loop.total_steps={steps}", f"checkpoint.root={root}",
                                "report.tensorboard=false", *extra])


def _weights(root, run: str, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(f"{root}/{run}/step-{step:08d}/model.safetensors")


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _pid(name: str) -> int:
    return cluster.current_pool().call(name, "pid", what="test")


BF16 = {"tiny-grpo": ["lm.model.dtype=bfloat16"], "tiny-flow-grpo": ["diffusion.model.dtype=bfloat16"]}


@pytest.mark.parametrize("recipe, precision", [("tiny-grpo", "fp32"), ("tiny-flow-grpo", "fp32"), ("tiny-nft", "fp32"),
                                               ("tiny-grpo", "bf16"), ("tiny-flow-grpo", "bf16")])
def test_shared_placement_equals_the_in_process_loop_bitwise(tmp_path, recipe, precision):
    """tiny-nft samples with the trainer's EMA (DiffusionNFT's old_policy: ema), which the engine actors of the
    other placements cannot. bf16: the shared engine reads the trainer's fp32 masters cast to bf16, the in-process
    rollout bundle loads each fp32 version into bf16 weights; the same rounding, so the same bits."""
    steps = 3
    extra = BF16[recipe] if precision == "bf16" else []
    t0 = time.perf_counter()
    local = run_local(_cfg(recipe, tmp_path / "local", steps, *extra), progress=False)
    runs = {"local": local}
    if recipe != "tiny-nft" and precision == "fp32":  # and a placement with an engine actor (weights published)
        runs["colocate"] = run_local(_cfg(recipe, tmp_path / "colocate", steps, "pool.execution=pool"),
                                     progress=False)
    t1 = time.perf_counter()
    shared = run_local(_cfg(recipe, tmp_path / "shared", steps, *SHARED, *extra), progress=False)
    print(f"{recipe} {precision}: in-process (+ colocate) {t1 - t0:.1f} s, shared {time.perf_counter() - t1:.1f} s (incl. actor start)")
    for other, hist in runs.items():
        assert [h["reward/mean"] for h in shared] == [h["reward/mean"] for h in hist], other
        assert [h["train/loss"] for h in shared] == [h["train/loss"] for h in hist], other
        for k in range(1, steps + 1):
            assert _same_weights(_weights(tmp_path / "shared", recipe, k), _weights(tmp_path / other, recipe, k))
    if recipe != "tiny-nft":  # on-policy: the engine's bits are the replay's
        assert all(h["train/ratio_mean"] == 1.0 and h["train/logp_absdiff_max"] == 0.0 for h in shared)
    pool = cluster.current_pool()
    assert pool.live == ["reward-0", "shared"] and pool.bundle_of == {"shared": 0, "reward-0": 0}
    # one process: the state is restored once (at start), then the trainer's module is the engine's
    assert [h["pool/weights_from_store"] for h in shared] == [1.0, 0.0, 0.0]
    assert [h["pool/trainer_restored"] for h in shared] == [1.0, 0.0, 0.0]
    assert all(h["pool/publish_bytes"] == 0.0 and h["pool/publish_shared"] == 1.0 for h in shared)
    assert all(h["pool/engines_serving"] == 1.0 and h["pool/resampled_shards"] == 0.0 for h in shared)
    latest = CheckpointStore(str(tmp_path / "shared"), recipe).latest()
    assert tuple(pool.call("shared", "served_version", what="test")) == (latest.uri, steps)


def test_killed_shared_actor_fails_typed_and_the_retry_is_bitexact(tmp_path):
    recipe, steps = "tiny-grpo", 4
    cfg = _cfg(recipe, tmp_path / "shared", steps, *SHARED)
    store = CheckpointStore(str(tmp_path / "shared"), cfg.name)

    def kill_after_2(metrics, batch):
        if metrics["step"] == 2.0:
            # the actor writes version 2 on its thread (run_local): let it land, so LATEST is 2 for sure
            cluster.current_pool().call("shared", "wait_version", what="test")
            os.kill(_pid("shared"), signal.SIGKILL)

    with pytest.raises(PoolActorDied, match="'shared'.*rollout step 3"):
        run_local(cfg, on_step=kill_after_2, progress=False)
    assert store.latest().step == 2 and [r.step for r in store.versions()] == [0, 1, 2]
    rest = run_local(cfg, progress=False)  # the retry: a new shared actor restores step 2 from the store
    assert [h["step"] for h in rest] == [3.0, 4.0]
    assert [h["pool/weights_from_store"] for h in rest] == [1.0, 0.0]
    assert [h["pool/trainer_restored"] for h in rest] == [1.0, 0.0]
    ref = run_local(_cfg(recipe, tmp_path / "local", steps), progress=False)
    assert [h["reward/mean"] for h in rest] == [h["reward/mean"] for h in ref[2:]]
    assert _same_weights(_weights(tmp_path / "shared", recipe, 4), _weights(tmp_path / "local", recipe, 4))


def test_batch_lost_between_rollout_and_train_is_resampled_and_checked(tmp_path):
    """The shared actor dies after the rollout: the train call fails naming it, the retry samples the shard again
    (same seed, from the restored version) and trains bit-exactly."""
    recipe = "tiny-flow-grpo"
    cfg = _cfg(recipe, tmp_path / "shared", 1, *SHARED)
    ckpt = phases.init_run(cfg)
    batch, _ = phases.rollout_phase(cfg, ckpt, step=1)
    os.kill(_pid("shared"), signal.SIGKILL)
    batch, _ = phases.reward_phase(cfg, batch)
    batch, _ = phases.advantage_phase(cfg, batch, ckpt)
    with pytest.raises(PoolActorDied, match="'shared'.*train step 1"):
        phases.train_phase(cfg, batch, ckpt, step=1)
    new, metrics = phases.train_phase(cfg, batch, ckpt, step=1)  # the retry
    assert metrics["pool/resampled_shards"] == 1.0 and metrics["train/ratio_mean"] == 1.0
    assert metrics["pool/trainer_restored"] == 1.0
    run_local(_cfg(recipe, tmp_path / "local", 1), progress=False)
    assert _same_weights(_weights(tmp_path / "shared", recipe, 1), _weights(tmp_path / "local", recipe, 1))


def test_flyte_workflow_with_the_shared_placement(tmp_path):
    """The typed phase tasks as thin clients of the shared actor (local pyflyte semantics): same versions and
    report as the in-process loop."""
    import json

    from workflows.grpo import grpo

    recipe, name = "tiny-grpo", "t-pool-shared-wf"
    out = grpo(recipe=recipe, overrides=[*tiny_overrides(recipe, str(tmp_path / "pool"), name), *SHARED,
                                         "checkpoint.keep_last=1"])
    assert out.step == 2
    assert cluster.current_pool().live == ["reward-0", "shared"]
    # the publish task moved LATEST and left retention to the actor's writer thread: done once that is waited for
    cluster.current_pool().call("shared", "wait_version", what="test")
    store = CheckpointStore(str(tmp_path / "pool"), name)
    assert store.latest().step == 2 and [r.step for r in store.versions()] == [2]
    assert sorted(p.name for p in (tmp_path / "pool" / name).glob("step-*")) == ["step-00000002"]
    ref = run_local(load_recipe(recipe, tiny_overrides(recipe, str(tmp_path / "local"), name)), progress=False)
    assert _same_weights(_weights(tmp_path / "pool", name, 2), _weights(tmp_path / "local", name, 2))
    metrics = json.loads((tmp_path / "pool" / name / "report" / "step-00000002" / "metrics.json").read_text())
    assert metrics["metrics"]["reward/mean"] == ref[1]["reward/mean"]
    assert metrics["metrics"]["pool/weights_from_store"] == 0.0 and metrics["metrics"]["pool/shared"] == 1.0
