"""The rollout manager: admission never exceeds the lag (property test over random completion orders),
max_inflight holds, quiesce drains and pauses, a failed resolve/route poisons every later call."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unirl_core.errors import ConfigError, InvariantError
from unirl_core.rollout.manager import ManagerConfig, RolloutManager, RolloutRequest, check_batch_provenance
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch

torch.set_num_threads(1)


class HandLauncher:
    """Futures a test completes by hand, in any order; records the peak number running at once."""

    def __init__(self) -> None:
        self.running: list[tuple[RolloutRequest, Future]] = []
        self.peak = 0

    def __call__(self, req: RolloutRequest) -> Future:
        fut: Future = Future()
        self.running.append((req, fut))
        self.peak = max(self.peak, len(self.running))
        return fut

    def complete(self, index: int) -> RolloutRequest:
        req, fut = self.running.pop(index)
        fut.set_result(("batch", req.step, req.shard, req.policy_version))
        return req


@settings(max_examples=150, deadline=None)
@given(lag=st.integers(0, 3), inflight=st.integers(1, 4), shards=st.integers(1, 2),
       policy=st.sampled_from(["pinned", "latest"]), steps=st.integers(1, 8), data=st.data())
def test_admission_never_exceeds_lag(lag, inflight, shards, policy, steps, data):
    """For every completion order: each taken request was sampled with version v and trained from version
    n - 1 with 0 <= (n - 1) - v <= lag; at most max_inflight ran at once; results keep their provenance."""
    launcher = HandLauncher()
    cfg = ManagerConfig(max_policy_lag=lag, max_inflight=inflight, num_shards=shards, version_policy=policy)
    m = RolloutManager(cfg, launcher)
    m.pump()
    trainer_version = 0
    for n in range(1, steps + 1):
        while not all((n, s) in {(r.step, r.shard) for r in m.buffered} for s in range(shards)):
            assert launcher.running, "the step's work is neither buffered nor running: dispatch stalled"
            launcher.complete(data.draw(st.integers(0, len(launcher.running) - 1)))
            m.pump()
            assert len(launcher.running) <= inflight
        got = m.take(n)
        for req, result in zip(got.requests, got.results):
            assert req.step == n
            assert 0 <= trainer_version - req.policy_version <= lag
            assert req.policy_version <= trainer_version
            assert result == ("batch", n, req.shard, req.policy_version)
            if policy == "pinned":
                assert req.policy_version == max(0, n - 1 - lag)
        assert got.metrics()["async/staleness_max"] <= lag
        trainer_version += 1
        m.publish(trainer_version)
    assert launcher.peak <= inflight
    # never more than lag + 1 steps ahead of training were dispatched
    assert max(r.step for r in m.dispatched) <= steps + 1 + lag


def test_pinned_lag_one_overlaps_one_step():
    """lag 1, two slots: step 2 is dispatched with version 0 before step 1 is trained; step 3 waits for v1."""
    launcher = HandLauncher()
    m = RolloutManager(ManagerConfig(max_policy_lag=1, max_inflight=2), launcher)
    m.pump()
    assert [(r.step, r.policy_version) for r in m.dispatched] == [(1, 0), (2, 0)]
    launcher.complete(1)  # step 2 finishes first
    launcher.complete(0)
    assert m.take(1).requests[0].staleness == 0
    assert [r.step for r in m.dispatched] == [1, 2]  # step 3 needs version 1
    m.publish(1)
    assert [(r.step, r.policy_version) for r in m.dispatched][-1] == (3, 1)
    got = m.take(2)
    assert got.requests[0].staleness == 1 and got.buffer_depth == 0
    assert {k: v for k, v in got.metrics(1).items() if "hist" in k} == {"async/staleness_hist/0": 0.0,
                                                                         "async/staleness_hist/1": 1.0}


def test_take_refuses_a_step_that_can_never_be_dispatched():
    m = RolloutManager(ManagerConfig(max_policy_lag=0, max_inflight=2), HandLauncher().__call__)
    m.pump()
    with pytest.raises(InvariantError, match="take"):
        m.take(2)
    m2 = RolloutManager(ManagerConfig(max_policy_lag=0, max_inflight=1), HandLauncher())
    launcher = m2._launch
    m2.pump()
    launcher.complete(0)
    m2.take(1)
    with pytest.raises(InvariantError, match="publish version"):
        m2.take(2)  # version 1 not published


def test_quiesce_drains_inflight_and_pauses_dispatch():
    """Threads complete work in random order; quiesce returns only when nothing is in flight, and publish
    while paused dispatches nothing until resume."""
    pool = ThreadPoolExecutor(max_workers=3)
    delays = [0.03, 0.001, 0.02, 0.01, 0.005, 0.015]

    def work(req: RolloutRequest):
        time.sleep(delays[(req.step + req.shard) % len(delays)])
        return req.step

    m = RolloutManager(ManagerConfig(max_policy_lag=2, max_inflight=3, num_shards=2),
                       lambda r: pool.submit(work, r))
    try:
        m.pump()
        assert m.inflight == 3
        buffered = m.quiesce(timeout=10)
        assert m.inflight == 0 and buffered == 3
        assert len(m.dispatched) == 3
        m.publish(1)
        assert len(m.dispatched) == 3  # paused
        m.resume()
        assert len(m.dispatched) == 6
        assert [m.take(1, timeout=10).results, m.take(2, timeout=10).results] == [[1, 1], [2, 2]]
    finally:
        m.close()
        pool.shutdown()


def test_failed_resolve_poisons_every_later_call():
    boom = RuntimeError("engine-0 died")
    launcher = HandLauncher()
    m = RolloutManager(ManagerConfig(max_policy_lag=1, max_inflight=2), launcher)
    m.pump()
    launcher.running[1][1].set_exception(boom)
    calls = [lambda: m.take(1), m.pump, lambda: m.publish(1), m.quiesce, m.resume, lambda: m.inflight,
             lambda: m.buffered]
    for call in calls:
        with pytest.raises(RuntimeError) as info:
            call()
        assert info.value is boom
    m.close()  # the one safe call


def test_failed_route_poisons_with_the_provenance_error():
    """A result whose Parts record another version than the request's is a routing failure."""
    def launch(req: RolloutRequest) -> Future:
        batch = SampleBatch.from_prompts([PromptRecord(prompt_id="p", prompt="x")], samples_per_prompt=2, kind="ar", sampling=ARSamplingParams(),
                                         policy_version=req.policy_version + 1)
        fut: Future = Future()
        fut.set_result(batch)
        return fut

    m = RolloutManager(ManagerConfig(), launch, check=check_batch_provenance)
    with pytest.raises(InvariantError, match="policy_version") as info:
        m.take(1)
    with pytest.raises(InvariantError) as again:
        m.publish(1)
    assert again.value is info.value


def test_launch_failure_poisons_and_config_errors_name_the_field():
    def launch(req):
        raise OSError("no engine")

    m = RolloutManager(ManagerConfig(), launch)
    with pytest.raises(OSError) as info:
        m.pump()
    with pytest.raises(OSError) as again:
        m.take(1)
    assert again.value is info.value
    with pytest.raises(ConfigError, match="manager.max_inflight"):
        ManagerConfig(max_inflight=0)
    with pytest.raises(ConfigError, match="manager.version_policy"):
        ManagerConfig(version_policy="newest")


def test_take_timeout_and_completion_from_another_thread():
    launcher = HandLauncher()
    m = RolloutManager(ManagerConfig(), launcher)
    m.pump()
    with pytest.raises(TimeoutError):
        m.take(1, timeout=0.05)
    m2 = RolloutManager(ManagerConfig(), launcher)  # take(1) above did not count: it raised
    m2.pump()
    t = threading.Timer(0.05, lambda: launcher.complete(len(launcher.running) - 1))
    t.start()
    assert m2.take(1, timeout=10).results[0][1] == 1


def test_nothing_is_dispatched_past_the_last_step():
    """last_step (the run's loop.total_steps): the lag would admit step 4 with version 2, but the run ends at 3."""
    launcher = HandLauncher()
    m = RolloutManager(ManagerConfig(max_policy_lag=1, max_inflight=4, last_step=3), launcher)
    m.pump()
    for step in (1, 2, 3):
        while launcher.running:
            launcher.complete(0)
        got = m.take(step)
        assert got.requests[0].policy_version == max(0, step - 2)
        m.publish(step)
    assert [r.step for r in m.dispatched] == [1, 2, 3] and m.inflight == 0
    with pytest.raises(ConfigError, match="manager.last_step"):
        ManagerConfig(last_step=0)
