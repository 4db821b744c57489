"""A named pool (``pool.name``) on a real local Ray cluster: LoRA runs of several driver processes attach to one
warm set of actors, each bitwise equal to the same run alone, one SIGKILLed driver leaves the others finishing and
its versions intact, a client without the cluster's token is refused, and the pool ends itself when idle."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import safetensors.torch
import torch

from tests.flyte.conftest import SMALL
from tests.integration.pool_support import local_ray_fixture, ray, time_limit_fixture
from unirl_core.checkpoint import CheckpointStore
from unirl_core.checkpoint.store import load_manifest
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local
from unirl_core.pool import cluster
from unirl_core.pool.cluster import NAMESPACE

pytestmark = pytest.mark.integration

time_limit = time_limit_fixture(180)
local_ray = local_ray_fixture()

LORA = {"tiny-grpo": "lm.model.finetune=lora", "tiny-flow-grpo": "diffusion.model.finetune=lora"}

DRIVER = r"""
import json, os, pathlib, sys, time
import ray
from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local
from unirl_core.pool import cluster
barrier = pathlib.Path(os.environ["BARRIER_DIR"]) if os.environ.get("BARRIER_DIR") else None
try:
    hist = run_local(load_recipe(sys.argv[1], sys.argv[3:]))
finally:  # a failed run arrives too (and exits with its error): the others do not wait for it
    if barrier is not None:
        (barrier / pathlib.Path(sys.argv[2]).name).touch()
if barrier is not None:  # stay attached (a run detaches at exit) until every run of the test finished
    deadline = time.monotonic() + 120
    while len(list(barrier.iterdir())) < int(os.environ["BARRIER_N"]) and time.monotonic() < deadline:
        time.sleep(0.2)
pool = cluster.current_pool()
pids = {role: pool.call(role, "pid", what="test") for role in sorted(pool.roles)}
memory = {role: ray.get(host.memory.remote()) for role, host in pool.hosts.items()}
with open(sys.argv[2], "w") as f:
    json.dump({"history": hist, "pids": pids, "pool": type(pool).__name__, "attached": pool.info["runs"],
               "memory": memory}, f)
"""


def _overrides(recipe: str, root, name: str, steps: int, *extra: str) -> list[str]:
    return [*SMALL[recipe], LORA[recipe], f"loop.total_steps={steps}", f"checkpoint.root={root}", f"name={name}",
            *extra]


def _named(pool: str, *extra: str) -> list[str]:
    # a quarter CPU per role (one torch thread each): several pools fit the module's 2-CPU head
    return ["pool.execution=pool", f"pool.name={pool}", "pool.publish=object_store", "pool.engine.num_cpus=0.25",
            "pool.trainer.num_cpus=0.25", f"pool.address={ray.get_runtime_context().gcs_address}", *extra]


ROLES = ("registry", "engine-0", "trainer", "reward-0")


def _remove(pool: str) -> None:
    """End a test's pool (its hosts, registry and placement group)."""
    from ray.util import remove_placement_group

    registry = ray.get_actor(f"{pool}-registry", namespace=NAMESPACE)
    remove_placement_group(ray.get(registry.placement_group.remote([], "PACK", 1.0), timeout=60))
    for role in ROLES:
        try:
            ray.kill(ray.get_actor(f"{pool}-{role}", namespace=NAMESPACE), no_restart=True)
        except (ValueError, AssertionError):  # gone, or (Ray's assertion) its class left with its driver's job:
            pass  # the placement group's removal above ends it


@contextlib.contextmanager
def _ended_on_failure(pool: str, procs: list[subprocess.Popen]):
    """A failing test kills its drivers still running and ends its pool: the module's later tests share the
    2-CPU head and would otherwise wait behind them (a cascade of timeouts instead of one failure)."""
    try:
        yield
    except BaseException:
        signal.alarm(60)  # the test's own bound may be what fired: the cleanup gets one of its own
        try:
            for proc in procs:
                try:
                    proc.kill()
                    proc.wait(timeout=10)
                except Exception:  # noqa: BLE001 (gone already, or stuck: the others are still killed)
                    pass
            try:
                _remove(pool)
            except Exception:  # noqa: BLE001 (never created, gone, or stuck: the test's own error is the one to see)
                pass
        finally:
            signal.alarm(0)
        raise


def _driver(recipe: str, root, name: str, steps: int, out, *extra: str, env=None) -> subprocess.Popen:
    args = [sys.executable, "-c", DRIVER, recipe, str(out), *_overrides(recipe, root, name, steps, *extra)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen, out) -> dict:
    _, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err[-4000:]
    with open(out) as f:
        return json.load(f)


def _weights(root, run: str, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(f"{root}/{run}/step-{step:08d}/model.safetensors")


def _same_run(shared: list[dict], alone: list[dict], root_shared, root_alone, name: str) -> None:
    """Rewards, ratios and every version's weights bitwise equal."""
    for key in ("reward/mean", "train/ratio_mean", "train/logp_absdiff_max", "train/loss"):
        assert [h[key] for h in shared] == [h[key] for h in alone], (name, key)
    kept = [r.step for r in CheckpointStore(str(root_shared), name).versions()]
    assert kept == [r.step for r in CheckpointStore(str(root_alone), name).versions()] and kept[-1] == len(alone)
    for step in kept:
        a, b = _weights(root_shared, name, step), _weights(root_alone, name, step)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, step)


def _verify_versions(root, name: str) -> list[int]:
    """Every complete version's files match their manifest; returns their steps."""
    store = CheckpointStore(str(root), name)
    steps = []
    for ref in store.versions():
        manifest = load_manifest(ref)
        for file in manifest.files:
            with open(f"{root}/{name}/step-{ref.step:08d}/{file}", "rb") as f:
                manifest.verify(file, f.read(), ref.uri)
        steps.append(ref.step)
    return steps


def _runs(n: int) -> list[tuple[str, str]]:
    """``n`` runs alternating LM and diffusion, each its own seed."""
    return [(recipe, f"{'lm' if recipe == 'tiny-grpo' else 'dif'}-{i}")
            for i, recipe in zip(range(n), ["tiny-grpo", "tiny-flow-grpo"] * n)]


def _alone(tmp_path, runs: list[tuple[str, str]], steps: int) -> dict[str, list[dict]]:
    return {name: run_local(load_recipe(recipe, _overrides(recipe, tmp_path / "alone", name, steps,
                                                           f"loop.seed={i}")))
            for i, (recipe, name) in enumerate(runs)}


def test_four_drivers_share_one_pool_each_bitwise_as_alone(tmp_path):
    # two LM and two diffusion LoRA runs (two runs sharing: the SIGKILL test below)
    n, steps, pool = 4, 3, "share4"
    runs = _runs(n)
    t0 = time.perf_counter()
    # each driver reads the hosts' memory once all four finished (a barrier): a run that would otherwise finish and
    # detach before another attached (drivers start staggered on a loaded machine) shared with nobody
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = dict(os.environ, BARRIER_DIR=str(barrier), BARRIER_N=str(n))
    procs = [(_driver(recipe, tmp_path / "shared", name, steps, tmp_path / f"{name}.json", f"loop.seed={i}",
                      *_named(pool), env=env), tmp_path / f"{name}.json") for i, (recipe, name) in enumerate(runs)]
    with _ended_on_failure(pool, [p for p, _ in procs]):
        shared = {name: _finish(p, out) for (_, name), (p, out) in zip(runs, procs)}
        t1 = time.perf_counter()
        alone = _alone(tmp_path, runs, steps)
        print(f"{n} runs sharing pool {pool}: {t1 - t0:.1f} s; alone in-process {time.perf_counter() - t1:.1f} s")
        for name, got in shared.items():
            assert got["pool"] == "NamedPool"
            _same_run(got["history"], alone[name], tmp_path / "shared", tmp_path / "alone", name)
        # one process per role served every run
        assert len({json.dumps(got["pids"], sort_keys=True) for got in shared.values()}) == 1
        # the runs overlapped (at least until the barrier): the hosts hold tensors rebound between tenants (one
        # resident base per family), and the runs are still bitwise as alone (above)
        for got in shared.values():
            assert got["memory"]["trainer"]["shared_tensors"] > 0 and got["memory"]["engine-0"]["shared_tensors"] > 0, \
                {name: got["memory"] for name, got in shared.items()}
        registry = ray.get_actor(f"{pool}-registry", namespace=NAMESPACE)
        assert ray.get(registry.attached.remote()) == []  # every run detached at its exit
    _remove(pool)


def test_a_killed_driver_leaves_the_others_finishing_and_its_versions_intact(tmp_path):
    pool = "killone"
    victim_root = tmp_path / "shared"
    victim = _driver("tiny-grpo", victim_root, "victim", 40, tmp_path / "victim.json", "loop.seed=7", *_named(pool))
    others = [(_driver(recipe, victim_root, name, 4, tmp_path / f"{name}.json", f"loop.seed={i}", *_named(pool)),
               tmp_path / f"{name}.json") for i, (recipe, name) in enumerate(_runs(2))]
    store = CheckpointStore(str(victim_root), "victim")
    with _ended_on_failure(pool, [victim, *(p for p, _ in others)]):
        deadline = time.monotonic() + 120
        while (store.latest() is None or store.latest().step < 2) and time.monotonic() < deadline:
            assert victim.poll() is None, victim.stderr.read()[-3000:]
            time.sleep(0.2)
        os.kill(victim.pid, signal.SIGKILL)  # mid-run: its tenants may be mid-call
        victim.wait(timeout=30)
        shared = {name: _finish(p, out) for (_, name), (p, out) in zip(_runs(2), others)}
        alone = _alone(tmp_path, _runs(2), 4)
        for name, got in shared.items():
            _same_run(got["history"], alone[name], victim_root, tmp_path / "alone", name)
        # the killed run's versions are complete and verify; LATEST names one of them
        time.sleep(1.0)  # a background write that was under way finishes in its tenant
        steps = _verify_versions(victim_root, "victim")
        latest = store.latest()
        assert latest is not None and latest.step >= 2 and latest.step in steps
    _remove(pool)


def test_a_client_with_a_wrong_token_is_refused(tmp_path):
    env = {**os.environ, "RAY_AUTH_TOKEN": "0" * 32}
    proc = _driver("tiny-grpo", tmp_path, "intruder", 1, tmp_path / "out.json", *_named("guarded"), env=env)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "pool.address" in err and "token" in err and "RAY_AUTH_TOKEN" in err, err[-3000:]
    assert not (tmp_path / "out.json").exists()
    with pytest.raises(ValueError):  # it created nothing
        ray.get_actor("guarded-registry", namespace=NAMESPACE)


def test_an_idle_named_pool_removes_itself(tmp_path):
    cfg = load_recipe("tiny-grpo", _overrides("tiny-grpo", tmp_path, "brief", 1, *_named("brief",
                                                                                          "pool.idle_timeout_s=8")))
    run_local(cfg)
    assert ray.get_actor("brief-engine-0", namespace=NAMESPACE) is not None
    cluster.close_pool()  # the run detaches: its tenants are dropped, the pool stays for 8 s
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor("brief-registry", namespace=NAMESPACE)
        except ValueError:
            break
        time.sleep(0.5)
    for role in ROLES:
        with pytest.raises(ValueError):
            ray.get_actor(f"brief-{role}", namespace=NAMESPACE)
    from ray.util.placement_group import placement_group_table

    states = [pg["state"] for pg in placement_group_table().values() if pg["name"] == "brief-pg"]
    assert states and set(states) == {"REMOVED"}


def test_a_full_fine_tune_cannot_name_a_pool():
    with pytest.raises(ConfigError, match=r"pool.name.*finetune='full'.*keeps a pool of its own"):
        load_recipe("tiny-grpo", ["pool.execution=pool", "pool.name=p", "pool.publish=object_store"])
    with pytest.raises(ConfigError, match="pool.publish"):
        load_recipe("tiny-grpo", ["pool.execution=pool", "pool.name=p", LORA["tiny-grpo"]])


def _compile_sweep_runs(recipe: str, overrides: list[str], variants: list[list[str]], pool: str, address: str):
    """``sweep_runs`` compiled as a cluster pod compiles it (TASK_EXECUTION mode): its DynamicJobSpec."""
    from flytekit.configuration import ImageConfig, SerializationSettings
    from flytekit.core.context_manager import ExecutionState, FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    from workflows.sweep import sweep_runs

    settings = SerializationSettings(project="p", domain="d", version="v1",
                                     image_config=ImageConfig.auto_default_image())
    sweep_runs._wf = None  # flytekit caches a compiled dynamic body on the task object
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_serialization_settings(settings)) as ctx:
        es = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(es)) as ctx:
            inputs = TypeEngine.dict_to_literal_map(
                ctx, {"recipe": recipe, "overrides": overrides, "variants": variants, "pool_name": pool,
                      "pool_address": address, "max_steps": 0},
                type_hints={"recipe": str, "overrides": list[str], "variants": list[list[str]], "pool_name": str,
                            "pool_address": str, "max_steps": int})
            spec = sweep_runs.dispatch_execute(ctx, inputs)
    sweep_runs._wf = None
    return spec


@pytest.mark.time_limit(240)
def test_the_sweep_workflow_under_flytekit_runs_each_variant_in_the_named_pool_bitwise_as_alone(tmp_path):
    """``workflows/sweep.py`` executed by flytekit (local execution, the grpo subworkflows' phase tasks thin clients
    of the pool): two LoRA variants attach to one named pool, each run's versions bitwise the same run alone; each
    version's saved config names the pool, the pool's one host per role served both (its tenants built in turn),
    and a cluster pod's compiled sweep names each run's node ``pool-<name>-<i>``."""
    from unirl_core.checkpoint.store import CONFIG, load_version_json
    from unirl_core.pool.tenants import NamedPool
    from workflows.sweep import sweep

    recipe, pool, steps = "tiny-grpo", "sweep", 2
    gcs = ray.get_runtime_context().gcs_address
    common = [*SMALL[recipe], LORA[recipe], f"loop.total_steps={steps}", f"checkpoint.root={tmp_path / 'shared'}",
              "pool.engine.num_cpus=0.25", "pool.trainer.num_cpus=0.25"]
    variants = [["loop.seed=0"], ["loop.seed=1", "train.lr=3e-4"]]
    out = sweep(recipe=recipe, overrides=common, variants=variants, pool_name=pool, pool_address=gcs)
    names = [f"{pool}-{i}" for i in range(len(variants))]
    assert [(r.run, r.step) for r in out] == [(n, steps) for n in names]
    current = cluster.current_pool()  # the last run's view, still attached
    assert isinstance(current, NamedPool) and current.pool_name == pool
    pids = {role: current.call(role, "pid", what="test") for role in sorted(current.roles)}
    hosts = {role: ray.get_actor(f"{pool}-{role}", namespace=NAMESPACE) for role in current.roles}
    assert {role: ray.get(h.pid.remote()) for role, h in hosts.items()} == pids  # the tenants live in the hosts
    # local execution runs the variants one after the other: the first detached when the second attached (no
    # overlap, so no base to share); the processes stayed
    assert ray.get(hosts["trainer"].memory.remote())["tenants"] == 1
    for i, (name, variant) in enumerate(zip(names, variants)):
        for ref in CheckpointStore(str(tmp_path / "shared"), name).versions():
            saved = load_version_json(ref, CONFIG)
            assert (saved["pool"]["name"], saved["pool"]["address"]) == (pool, gcs), (name, ref.step)
        alone = run_local(load_recipe(recipe, [*SMALL[recipe], LORA[recipe], f"loop.total_steps={steps}",
                                               f"checkpoint.root={tmp_path / 'alone'}", f"name={name}", *variant]))
        kept = [r.step for r in CheckpointStore(str(tmp_path / "shared"), name).versions()]
        assert kept == [r.step for r in CheckpointStore(str(tmp_path / "alone"), name).versions()]
        assert kept[-1] == steps
        for step in kept:
            a, b = _weights(tmp_path / "shared", name, step), _weights(tmp_path / "alone", name, step)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, step)
        assert len(alone) == steps
    # the comparison is not vacuous: the second variant's adapter moved (its rollouts had rewards to learn from)
    first, last = _weights(tmp_path / "shared", names[1], 0), _weights(tmp_path / "shared", names[1], steps)
    assert any(not torch.equal(first[k], last[k]) for k in first)
    cluster.close_pool()
    _remove(pool)
    # what a cluster pod of the sweep compiles: one grpo subworkflow node per variant, named after the pool
    spec = _compile_sweep_runs(recipe, common, variants, pool, gcs)
    assert [n.id for n in spec.nodes] == [f"pool-{pool}-{i}" for i in range(len(variants))]
