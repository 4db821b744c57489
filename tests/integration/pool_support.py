"""What the pool's integration modules share: a per-test time bound and one local Ray head per module.

Each module binds them by name (``time_limit = time_limit_fixture(240)``, ``local_ray = local_ray_fixture()``),
so pytest sees ordinary autouse fixtures. Ray is imported after ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set,
so every head a test starts binds loopback only, as the pool's own head does."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray

from unirl_core.pool import cluster


def time_limit_fixture(seconds: int):
    """An autouse fixture bounding each test to ``seconds`` (``@pytest.mark.time_limit(s)`` gives one test its
    own bound): a hung actor call fails the test instead of the CI run."""

    @pytest.fixture(autouse=True)
    def time_limit(request):
        marker = request.node.get_closest_marker("time_limit")
        limit = marker.args[0] if marker else seconds

        def expire(signum, frame):
            raise TimeoutError(f"test ran past {limit} s")

        old = signal.signal(signal.SIGALRM, expire)
        signal.alarm(limit)
        yield
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)

    return time_limit


def local_ray_fixture(close: Callable[[], None] = cluster.close_pool):
    """A module-scoped autouse fixture: one local 2-CPU Ray head the module's pools attach to (``pool.address``
    unset, Ray initialised); ``close`` ends the module's pools before the head stops."""

    @pytest.fixture(scope="module", autouse=True)
    def local_ray():
        t0 = time.perf_counter()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        print(f"ray head started in {time.perf_counter() - t0:.1f} s")
        yield
        close()
        ray.shutdown()

    return local_ray
