"""Lagged rollouts in the pool (``async_training.max_policy_lag >= 1`` with ``pool.execution: pool``) on a real
local Ray cluster (2 CPUs): the rollout manager overlaps rollout n + 1 on the engine actors with train n on the
trainer actor, quiesces them before each in-pool publish, keeps provenance, and a dead engine fails the run with
a typed error; the numbers equal the in-process lagged loop's (fp32, bitwise)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import safetensors.torch
import torch

from tests.flyte.conftest import SMALL
from tests.integration.pool_support import local_ray_fixture, time_limit_fixture
from unirl_core.checkpoint import CheckpointStore
from unirl_core.config import load_recipe
from unirl_core.errors import PoolActorDied
from unirl_core.loop.local import run_local
from unirl_core.pool import cluster

pytestmark = pytest.mark.integration
POOL = ["pool.execution=pool"]
LAG1 = ["async_training.max_policy_lag=1"]
# AReaL's decoupled objective: pi_old replayed by the trainer, the behaviour weight truncated at 2
DECOUPLED = {"tiny-grpo": ["train.old_logp_source=replay", "lm.algorithm.tis_cap=2.0",
                           "lm.algorithm.mis_bounds=[0.5, 2.0]"],
             "tiny-flow-grpo": ["train.old_logp_source=replay", "diffusion.algorithm.old_logp_source=replay",
                                "diffusion.algorithm.tis_cap=2.0"]}
TEST_LIMIT_S = 240


time_limit = time_limit_fixture(TEST_LIMIT_S)
local_ray = local_ray_fixture()


def _cfg(recipe: str, root, steps: int, *extra: str):
    return load_recipe(recipe, [*SMALL[recipe], f"loop.total_steps={steps}", f"checkpoint.root={root}",
                                "report.tensorboard=false", *DECOUPLED[recipe], *extra])


def _weights(root, run: str, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(f"{root}/{run}/step-{step:08d}/model.safetensors")


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _numbers(hist: list[dict]) -> list[tuple]:
    return [(h["reward/mean"], h["train/loss"], h["train/is_weight_mean"]) for h in hist]


@pytest.mark.parametrize("recipe, extra", [
    ("tiny-grpo", []),
    ("tiny-flow-grpo", []),
    # two engines, one shard each: both are drained before the collective publish reaches them
    ("tiny-grpo", ["pool.num_engines=2", "loop.rollout_shards=2", "pool.engine.num_cpus=0.5",
                   "train.micro_batch_size=4", "lm.engine.forward_batch_size=4"]),
])
def test_lag_one_in_the_pool_equals_the_in_process_lagged_loop_bitwise(tmp_path, recipe, extra):
    steps = 4
    t0 = time.perf_counter()
    local = run_local(_cfg(recipe, tmp_path / "local", steps, *LAG1, *extra), progress=False)
    t1 = time.perf_counter()
    pool = run_local(_cfg(recipe, tmp_path / "pool", steps, *LAG1, *POOL, *extra), progress=False)
    print(f"{recipe} {extra}: in-process {t1 - t0:.1f} s, pool {time.perf_counter() - t1:.1f} s (incl. actor start)")
    assert _numbers(pool) == _numbers(local)
    for k in (steps - 1, steps):  # the versions checkpoint.keep_last (2) keeps
        assert _same_weights(_weights(tmp_path / "pool", recipe, k), _weights(tmp_path / "local", recipe, k))
    # provenance: step n samples version n - 2 (step 1: version 0); every sample within the lag when trained
    assert [h["async/staleness_max"] for h in pool] == [0.0, 1.0, 1.0, 1.0]
    assert [h["train/staleness_max"] for h in pool] == [0.0, 1.0, 1.0, 1.0]
    assert all(h["train/staleness_mean"] == h["train/staleness_max"] for h in pool)
    assert pool[0]["train/is_weight_mean"] == 1.0 and any(h["train/is_weight_mean"] != 1.0 for h in pool[1:])
    # overlap: when step n is taken, rollout n + 1 is already dispatched (running on the engines, or done);
    # nothing is dispatched past the last step
    shards = 2 if "loop.rollout_shards=2" in extra else 1
    assert [h["async/inflight"] + h["async/buffer_depth"] for h in pool] == [float(shards)] * (steps - 1) + [0.0]
    # the engines sample versions 0 and 1 ... from the in-pool publish; only step 1's version 0 comes from the store
    assert [h["pool/weights_from_store"] for h in pool] == [1.0] + [0.0] * (steps - 1)
    engines = 2.0 if "pool.num_engines=2" in extra else 1.0
    assert all(h["pool/engines_serving"] == engines for h in pool)
    assert all(h["async/publish_quiesce_s"] >= 0.0 for h in pool)
    assert [h["pool/trainer_restored"] for h in pool] == [1.0] + [0.0] * (steps - 1)


def test_sync_and_inline_lag_in_the_pool(tmp_path):
    """overlap=false dispatches and waits (same numbers as the overlapped run); the synchronous pool (lag 0) is not
    changed by the manager's existence (its step 1 equals lag 1's: both sample version 0)."""
    recipe, steps = "tiny-grpo", 3
    over = run_local(_cfg(recipe, tmp_path / "o", steps, *LAG1, *POOL), progress=False)
    inline = run_local(_cfg(recipe, tmp_path / "i", steps, *LAG1, *POOL, "async_training.overlap=false"),
                       progress=False)
    sync = run_local(_cfg(recipe, tmp_path / "s", steps, *POOL), progress=False)
    assert _numbers(inline) == _numbers(over)
    assert "async/engine_idle_frac" not in inline[1] and all(0 <= h["async/engine_idle_frac"] <= 1 for h in over[1:])
    assert sync[0]["reward/mean"] == over[0]["reward/mean"] and "async/staleness_max" not in sync[0]
    assert _numbers(sync)[1:] != _numbers(over)[1:]  # lag 1 trains stale samples under the behaviour weight


def test_a_dead_engine_fails_the_lagged_run_and_the_resumed_run_is_bitexact(tmp_path):
    """SIGKILL the engine right after step 1 (rollout 3 just dispatched to it): the run raises PoolActorDied naming
    the engine (from the manager when rollout 3 was running, from the train fetch of step 2's batch otherwise: that
    batch lived in the dead engine's object store); LATEST stays at 1; the re-run re-creates the engine, resamples
    the dropped buffer with its pinned versions and seeds, and ends bit-exact with an uninterrupted run."""
    recipe, steps = "tiny-grpo", 4
    cfg = _cfg(recipe, tmp_path / "pool", steps, *LAG1, *POOL)
    store = CheckpointStore(str(tmp_path / "pool"), cfg.name)

    def kill_engine_after_1(metrics, batch):
        if metrics["step"] == 1.0:
            os.kill(cluster.current_pool().call("engine-0", "pid", what="test"), signal.SIGKILL)

    with pytest.raises(PoolActorDied, match=r"'engine-0'.*(rollout step 3|train step 2: fetching shard 0)"):
        run_local(cfg, on_step=kill_engine_after_1, progress=False)
    assert store.latest().step == 1
    rest = run_local(cfg, progress=False)
    assert [h["step"] for h in rest] == [2.0, 3.0, 4.0]
    assert rest[0]["pool/weights_from_store"] == 1.0  # the new engine loads version 0 for step 2
    whole = run_local(_cfg(recipe, tmp_path / "whole", steps, *LAG1), progress=False)
    assert _numbers(rest) == _numbers(whole[1:])
    assert _same_weights(_weights(tmp_path / "pool", recipe, steps), _weights(tmp_path / "whole", recipe, steps))


def test_flyte_lagged_workflow_in_pool_mode_matches_run_local(tmp_path):
    """The grpo workflow with lag 1 in pool mode (executed locally by flytekit: its tasks run one after another,
    each a thin client of the same pool): the chunked DAG samples version n - 2 for step n, read back from the
    store across a chunk, and reproduces the in-process lagged loop's numbers."""
    import json

    from tests.flyte.conftest import tiny_overrides
    from workflows.grpo import grpo

    recipe, name = "tiny-grpo", "t-pool-lag-wf"
    ov = [*tiny_overrides(recipe, str(tmp_path / "wf"), name, steps=4, chunk=2), *DECOUPLED[recipe], *LAG1]
    out = grpo(recipe=recipe, overrides=[*ov, *POOL])
    assert out.step == 4
    report = tmp_path / "wf" / name / "report"
    flyte = [json.loads((report / f"step-{s:08d}" / "metrics.json").read_text())["metrics"] for s in range(1, 5)]
    local = run_local(_cfg(recipe, tmp_path / "local", 4, *LAG1), progress=False)
    assert [m["train/staleness_max"] for m in flyte] == [0.0, 1.0, 1.0, 1.0]
    for key in ("reward/mean", "train/loss", "train/is_weight_mean"):
        assert [m[key] for m in flyte] == [h[key] for h in local], key
