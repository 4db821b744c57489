"""``execution: pool`` on a real local Ray cluster (2 CPUs, one per module): same numbers as pods, recovery
from a killed actor, and pool settings that cannot work failing at setup with the field and the fix."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import safetensors.torch
import torch

from tests.flyte.conftest import SMALL, tiny_overrides
from tests.integration.pool_support import local_ray_fixture, ray, time_limit_fixture
from unirl_core.checkpoint import CheckpointStore
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError, PoolActorDied, TransientError
from unirl_core.loop import phases
from unirl_core.loop.local import run_local
from unirl_core.pool import cluster

pytestmark = pytest.mark.integration
POOL = ["pool.execution=pool"]
TEST_LIMIT_S = 120


time_limit = time_limit_fixture(TEST_LIMIT_S)
local_ray = local_ray_fixture()


def _cfg(recipe: str, root, steps: int, *extra: str):
    return load_recipe(recipe, [*SMALL[recipe], f"loop.total_steps={steps}", f"checkpoint.root={root}", *extra])


def _weights(root, run: str, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(f"{root}/{run}/step-{step:08d}/model.safetensors")


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _pid(name: str) -> int:
    pool = cluster.current_pool()
    return pool.call(name, "pid", what="test")


@pytest.mark.parametrize("recipe", ["tiny-grpo", "tiny-flow-grpo"])
def test_pool_equals_pods_bitwise(tmp_path, recipe):
    steps = 3
    t0 = time.perf_counter()
    pods = run_local(_cfg(recipe, tmp_path / "pods", steps))
    t1 = time.perf_counter()
    emitted = []
    pool = run_local(_cfg(recipe, tmp_path / "pool", steps, *POOL), on_step=lambda m, b: emitted.append(b))
    t2 = time.perf_counter()
    print(f"{recipe}: pods {t1 - t0:.1f} s, pool {t2 - t1:.1f} s (incl. actor start)")
    assert [h["reward/mean"] for h in pool] == [h["reward/mean"] for h in pods]
    for h in pool:
        assert h["train/ratio_mean"] == 1.0 and h["train/logp_absdiff_max"] == 0.0
    for k in range(1, steps + 1):
        assert _same_weights(_weights(tmp_path / "pool", recipe, k), _weights(tmp_path / "pods", recipe, k))
    # the trainer restored once (at start), then stayed resident; the engine loaded from the store once
    assert [h["pool/trainer_restored"] for h in pool] == [1.0, 0.0, 0.0]
    assert [h["pool/weights_from_store"] for h in pool] == [1.0, 0.0, 0.0]
    cfg = _cfg(recipe, tmp_path / "pool", steps, *POOL)
    again = phases.publish_phase(cfg, CheckpointStore(str(tmp_path / "pool"), cfg.name).latest())
    assert again["step"] == steps and again["pool/engines_pushed"] == 0.0  # the engine serves it: not pushed twice
    part = emitted[0].generated[0]
    assert part.conditions == {}
    if recipe == "tiny-flow-grpo":
        assert part.segment.latents.numel() == 0 and part.media


@pytest.mark.time_limit(240)
@pytest.mark.parametrize("recipe", ["tiny-grpo", "tiny-flow-grpo"])
def test_collective_publish_equals_store_reload_bitwise(tmp_path, recipe):
    """The trainer broadcasts each version to the engines over a gloo group (NCCL on GPUs): the same per-step
    rewards (fp32, bitwise) as pods, whose rollouts reload every version from the checkpoint store, and as the
    object-store publish; the engines serve the published version after every step without reading the store."""
    steps = 3
    two = [*POOL, "pool.num_engines=2", "loop.rollout_shards=2", "pool.engine.num_cpus=0.5"]
    if recipe == "tiny-grpo":  # 4 samples per shard: the train slices must equal the engine's
        two += ["train.micro_batch_size=4", "lm.engine.forward_batch_size=4"]
    store_path = run_local(_cfg(recipe, tmp_path / "store", steps, *two, "pool.publish=object_store"))
    reload = run_local(_cfg(recipe, tmp_path / "reload", steps, *two[1:]))  # pods: weights from the store
    collective = run_local(_cfg(recipe, tmp_path / "coll", steps, *two))
    rewards = [h["reward/mean"] for h in collective]
    assert rewards == [h["reward/mean"] for h in reload] == [h["reward/mean"] for h in store_path]
    assert [h["pool/publish_collective"] for h in collective] == [1.0] * steps
    assert [h["pool/engines_serving"] for h in collective] == [2.0] * steps  # served == published, every step
    assert [h["pool/publish_group_opened"] for h in collective] == [1.0, 0.0, 0.0]
    assert [h["pool/weights_from_store"] for h in collective] == [1.0, 0.0, 0.0]
    assert all(h["pool/publish_bytes"] > 0 for h in collective)
    assert [h["pool/publish_collective"] for h in store_path] == [0.0] * steps
    for k in range(1, steps + 1):
        assert _same_weights(_weights(tmp_path / "coll", recipe, k), _weights(tmp_path / "store", recipe, k))
    pool = cluster.current_pool()
    latest = CheckpointStore(str(tmp_path / "coll"), recipe).latest()
    for name in ("engine-0", "engine-1"):
        assert tuple(pool.call(name, "served_version", what="test")) == (latest.uri, steps)


def test_killed_actors_raise_typed_errors_and_the_retry_is_bitexact(tmp_path):
    recipe, steps = "tiny-grpo", 4
    cfg = _cfg(recipe, tmp_path / "pool", steps, *POOL)
    store = CheckpointStore(str(tmp_path / "pool"), cfg.name)

    def kill_engine_after_1(metrics, batch):
        if metrics["step"] == 1.0:
            os.kill(_pid("engine-0"), signal.SIGKILL)

    with pytest.raises(PoolActorDied, match="'engine-0'.*rollout step 2"):
        run_local(cfg, on_step=kill_engine_after_1)
    assert store.latest().step == 1 and [r.step for r in store.versions()] == [0, 1]

    def kill_trainer_after_2(metrics, batch):
        if metrics["step"] == 2.0:
            # the trainer writes version 2 on its thread (run_local): let it land, so LATEST is 2 for sure
            cluster.current_pool().call("trainer", "wait_version", what="test")
            os.kill(_pid("trainer"), signal.SIGKILL)

    with pytest.raises(PoolActorDied, match="'trainer'.*train step 3"):
        run_local(cfg, on_step=kill_trainer_after_2)  # the retry: a new engine resumes from LATEST (step 1)
    latest = store.latest()
    assert latest.step == 2 and (tmp_path / "pool" / cfg.name / "step-00000002" / "manifest.json").exists()
    assert json.loads((tmp_path / "pool" / cfg.name / "LATEST").read_text())["step"] == 2

    rest = run_local(cfg)  # a new trainer restores step 2 from the store
    assert [h["step"] for h in rest] == [3.0, 4.0]
    assert rest[0]["pool/trainer_restored"] == 1.0 and rest[1]["pool/trainer_restored"] == 0.0
    ref = run_local(_cfg(recipe, tmp_path / "pods", steps))
    assert [h["reward/mean"] for h in rest] == [h["reward/mean"] for h in ref[2:]]
    assert _same_weights(_weights(tmp_path / "pool", recipe, 4), _weights(tmp_path / "pods", recipe, 4))


def test_background_version_write_killed_anywhere_leaves_a_complete_latest(tmp_path):
    """run_local in pool mode: the trainer writes each version on its thread while the next rollout samples, and
    the thread publishes it once written. Killed right after step 2 (its write may or may not have landed): LATEST
    names a complete version (step 1 or 2), the resumed run ends bitwise equal to an uninterrupted in-process one.
    Through train_phase without ``asynchronous`` (the Flyte task), the version is complete when the phase returns."""
    recipe, steps = "tiny-grpo", 4
    cfg = _cfg(recipe, tmp_path / "pool", steps, *POOL)
    store = CheckpointStore(str(tmp_path / "pool"), cfg.name)
    history = []

    def kill_trainer_after_2(metrics, batch):
        history.append(metrics)
        if metrics["step"] == 2.0:
            os.kill(_pid("trainer"), signal.SIGKILL)  # no wait: the write of version 2 races the kill

    with pytest.raises(PoolActorDied, match="'trainer'.*train step 3"):
        run_local(cfg, on_step=kill_trainer_after_2, progress=False)
    assert history[1]["checkpoint/previous_write_s"] > 0  # step 2 waited for version 1, written on the thread
    latest = store.latest()
    assert latest.step in (1, 2)
    store.load(latest)  # every file there, sizes and sha256 as the manifest says
    rest = run_local(cfg, progress=False)
    assert [h["step"] for h in rest] == [float(s) for s in range(latest.step + 1, steps + 1)]
    ref = run_local(_cfg(recipe, tmp_path / "pods", steps), progress=False)
    assert [h["reward/mean"] for h in rest] == [h["reward/mean"] for h in ref[latest.step:]]
    assert _same_weights(_weights(tmp_path / "pool", recipe, 4), _weights(tmp_path / "pods", recipe, 4))
    assert store.latest().step == steps

    # the typed task's path: synchronous, the version is in the store (not yet published) when train returns
    cfg6 = _cfg(recipe, tmp_path / "pool", 6, *POOL)
    ckpt = store.latest()
    batch, _ = phases.rollout_phase(cfg6, ckpt, step=5)
    batch, _ = phases.reward_phase(cfg6, batch)
    batch, _ = phases.advantage_phase(cfg6, batch, ckpt)
    ref5, _ = phases.train_phase(cfg6, batch, ckpt, step=5)
    assert (tmp_path / "pool" / recipe / "step-00000005" / "manifest.json").exists()
    assert store.latest().step == 4
    store.load(ref5)


@pytest.mark.time_limit(300)
def test_sharded_state_every_n_steps_resumes_bitexact_after_a_trainer_crash(tmp_path):
    """checkpoint.full_state=sharded, every_n_steps=2: versions carry weights every step, the full state is a
    DCP folder every 2nd step (async) and at the end; a trainer killed after step 2 resumes from state-2
    bit-exactly; killed after step 5 (no full state of step 5) the restart fails naming the setting."""
    from unirl_core.checkpoint.sharded import state_versions
    from unirl_core.errors import CheckpointError

    recipe = "tiny-grpo"
    state = ["checkpoint.full_state=sharded", "checkpoint.every_n_steps=2", "checkpoint.keep_last=10"]
    cfg = _cfg(recipe, tmp_path / "pool", 4, *POOL, *state)
    root = tmp_path / "pool" / recipe

    def kill_trainer_after(k):
        def hook(metrics, batch):
            if metrics["step"] == float(k):
                cluster.current_pool().call("trainer", "wait_state", what="test")  # the write has landed
                os.kill(_pid("trainer"), signal.SIGKILL)
        return hook

    with pytest.raises(PoolActorDied, match="'trainer'.*train step 3"):
        run_local(cfg, on_step=kill_trainer_after(2))
    assert [s.step for s in state_versions(str(tmp_path / "pool"), recipe)] == [2]
    assert not (root / "step-00000001" / "train_state.pt").exists()
    assert not (root / "step-00000002" / "train_state.pt").exists()
    rest = run_local(cfg)  # a new trainer loads state-2 (DCP), then trains 3 and 4
    assert rest[0]["pool/trainer_restored"] == 1.0
    assert [s.step for s in state_versions(str(tmp_path / "pool"), recipe)] == [2, 4]  # the end: complete
    ref = run_local(_cfg(recipe, tmp_path / "pods", 4))
    assert [h["reward/mean"] for h in rest] == [h["reward/mean"] for h in ref[2:]]
    assert _same_weights(_weights(tmp_path / "pool", recipe, 4), _weights(tmp_path / "pods", recipe, 4))

    longer = _cfg(recipe, tmp_path / "pool", 6, *POOL, *state)
    with pytest.raises(PoolActorDied, match="'trainer'.*train step 6"):
        run_local(longer, on_step=kill_trainer_after(5))
    with pytest.raises(CheckpointError, match=r"checkpoint.every_n_steps=2: expected a full resumable state of "
                                              r"step 5 .* step 4"):
        run_local(longer)


def test_batch_lost_between_rollout_and_train_is_resampled_and_checked(tmp_path):
    """An engine that dies after the rollout (or a rollout task served from Flyte's cache) leaves the pool
    without the step's full batch: train re-samples it with the same seed and trains bit-exact."""
    recipe = "tiny-flow-grpo"
    cfg = _cfg(recipe, tmp_path / "pool", 1, *POOL)
    ckpt = phases.init_run(cfg)
    batch, _ = phases.rollout_phase(cfg, ckpt, step=1)
    os.kill(_pid("engine-0"), signal.SIGKILL)
    batch, _ = phases.reward_phase(cfg, batch)
    batch, _ = phases.advantage_phase(cfg, batch, ckpt)
    with pytest.raises(PoolActorDied, match="'engine-0'.*train step 1: fetching shard 0"):
        phases.train_phase(cfg, batch, ckpt, step=1)
    new, metrics = phases.train_phase(cfg, batch, ckpt, step=1)  # the retry
    assert metrics["pool/resampled_shards"] == 1.0 and metrics["train/ratio_mean"] == 1.0
    run_local(_cfg(recipe, tmp_path / "pods", 1))
    assert _same_weights(_weights(tmp_path / "pool", recipe, 1), _weights(tmp_path / "pods", recipe, 1))


def test_a_call_past_its_timeout_kills_the_actor_with_a_transient_error(tmp_path):
    cfg = _cfg("tiny-grpo", tmp_path, 1, *POOL, "pool.call_timeout_s=0.05")
    ckpt = phases.init_run(cfg)
    with pytest.raises(TransientError, match="'engine-0'.*rollout step 1.*pool.call_timeout_s=0.05"):
        phases.rollout_phase(cfg, ckpt, step=1)
    assert "engine-0" not in cluster.current_pool().live
    assert issubclass(PoolActorDied, TransientError)  # Flyte retries both (tasks.common.is_transient)


SELF_STARTED = r"""
import sys, ray
from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local
hist = run_local(load_recipe("tiny-grpo", sys.argv[1:]))
print("GCS", ray.get_runtime_context().gcs_address, hist[-1]["step"], flush=True)
"""


def test_pool_starts_a_local_head_and_stops_it_at_exit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = [*SMALL["tiny-grpo"], "loop.total_steps=1", f"checkpoint.root={tmp_path}", *POOL]
    res = subprocess.run([sys.executable, "-c", SELF_STARTED, *args], capture_output=True, text=True, timeout=100,
                         env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    gcs = res.stdout.split("GCS ")[1].split()
    host, port = gcs[0].rsplit(":", 1)
    assert host == "127.0.0.1" and gcs[1] == "1.0"
    assert gcs[0] != ray.get_runtime_context().gcs_address  # its own head, not this module's
    with pytest.raises(ConfigError, match="pool.address"):  # gone with the process
        cluster.probe_address(gcs[0], 2.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("extra, field", [
    ([f"pool.address=127.0.0.1:{_free_port()}", "pool.connect_timeout_s=2"], "pool.address"),
    (["pool.trainer.num_cpus=8"], "pool.trainer.num_cpus"),
    (["pool.engine.num_gpus=1"], "pool.engine.num_gpus"),
])
def test_bad_pool_config_fails_at_setup(tmp_path, extra, field):
    cfg = _cfg("tiny-grpo", tmp_path, 1, *POOL, *extra)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"{field}=.*expected .*; "):
        cluster.Pool.get(cfg)
    assert time.perf_counter() - t0 < 10


def test_busy_cluster_times_out_with_the_resources_asked(tmp_path):
    from ray.util import placement_group, remove_placement_group

    cluster.close_pool()
    hog = placement_group([{"CPU": 2}])
    ray.get(hog.ready(), timeout=30)
    try:
        cfg = _cfg("tiny-grpo", tmp_path, 1, *POOL, "pool.placement_timeout_s=1")
        with pytest.raises(ConfigError, match=r"pool.placement_timeout_s=1.*free now"):
            cluster.Pool.get(cfg)
    finally:
        remove_placement_group(hog)


def test_flyte_workflow_in_pool_mode_two_engines_separate(tmp_path):
    from workflows.grpo import grpo

    recipe, name = "tiny-flow-grpo", "t-pool-wf"
    # two engines (one per shard) in their own bundles next to the trainer's
    separate = ["pool.placement=separate", "pool.num_engines=2", "pool.engine.num_cpus=0.5"]
    out = grpo(recipe=recipe, overrides=[*tiny_overrides(recipe, str(tmp_path / "pool"), name), *POOL, *separate,
                                         "loop.rollout_shards=2"])
    assert out.step == 2
    pool = cluster.current_pool()
    assert pool.live == ["engine-0", "engine-1", "reward-0", "trainer"]
    assert pool.bundle_of == {"engine-0": 0, "engine-1": 1, "trainer": 2, "reward-0": -1}
    ref = run_local(load_recipe(recipe, [*tiny_overrides(recipe, str(tmp_path / "pods"), name),
                                         "loop.rollout_shards=2"]))
    assert len(ref) == 2
    assert _same_weights(_weights(tmp_path / "pool", name, 2), _weights(tmp_path / "pods", name, 2))
    metrics = json.loads((tmp_path / "pool" / name / "report" / "step-00000002" / "metrics.json").read_text())
    assert metrics["metrics"]["reward/mean"] == ref[1]["reward/mean"]


@pytest.mark.time_limit(240)
@pytest.mark.parametrize("publish", ["object_store", "collective"])
def test_engines_fed_deltas_sample_bitwise_as_engines_fed_full_weights(tmp_path, publish):
    """``checkpoint.weights_encoding: delta`` (bf16 weights, fp32 masters, a full state every 3 steps): an engine
    serving a delta's base takes the delta alone - from the store (object-store publish; checked against the
    version's digest) or on the wire from the trainer (collective publish; checked against the header's digests);
    the rewards (its rollouts) and every version's weights are bitwise the full-version pool run's."""
    from unirl_core.checkpoint import load_manifest, load_weights
    from unirl_core.checkpoint.delta import bits

    steps = 5
    common = [*POOL, f"pool.publish={publish}", "lm.model.dtype=bfloat16", "train.master_weights=fp32",
              "train.lr=1e-3", "checkpoint.every_n_steps=3", "checkpoint.keep_last=10"]
    full = run_local(_cfg("tiny-grpo", tmp_path / "full", steps, *common))
    delta = run_local(_cfg("tiny-grpo", tmp_path / "delta", steps, *common, "checkpoint.weights_encoding=delta"))
    assert [h["reward/mean"] for h in delta] == [h["reward/mean"] for h in full]
    assert [h["train/loss"] for h in delta] == [h["train/loss"] for h in full]
    stores = {k: CheckpointStore(str(tmp_path / k), "tiny-grpo") for k in ("full", "delta")}
    chains = {r.step: load_manifest(r).chain for r in stores["delta"].versions()}
    assert chains == {0: [], 1: [], 2: [1], 3: [], 4: [3], 5: []}
    for a, b in zip(stores["full"].versions(), stores["delta"].versions(), strict=True):
        wa, wb = load_weights(a), load_weights(b)
        assert wa.keys() == wb.keys() and all(torch.equal(bits(wa[k]), bits(wb[k])) for k in wa)
    assert all(h["pool/engines_serving"] == 1.0 for h in delta)
    if publish == "object_store":
        # versions 2 and 4 are deltas of 1 and 3, which the engine serves when they are published
        assert [h.get("pool/engines_fed_delta", 0.0) for h in delta] == [0.0, 1.0, 0.0, 1.0, 0.0]
        return
    # on the wire every version after the first is a delta of the one before (the store's anchors do not matter);
    # the store's delta files are not read; the first publish goes in full (the engine loaded v0 from the store)
    assert [h["pool/publish_delta"] for h in delta] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [h["pool/publish_delta"] for h in full] == [0.0] * steps
    assert [h["pool/publish_resent_full"] for h in delta] == [0.0] * steps  # every delta reproduced the version
    assert all("pool/engines_fed_delta" not in h for h in delta)
    assert delta[0]["pool/publish_bytes"] == full[0]["pool/publish_bytes"]
    assert all(d["pool/publish_bytes"] < f["pool/publish_bytes"] for d, f in zip(delta[1:], full[1:]))
    print("publish bytes full", [h["pool/publish_bytes"] for h in full], "delta",
          [h["pool/publish_bytes"] for h in delta])
