import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import shutil  # noqa: E402
import tempfile  # noqa: E402

_FLYTE_CACHE: str | None = None


def pytest_configure(config):
    """Give this test session its own flytekit local task cache.

    flytekit keeps it in ~/.flyte/local-cache, which outlives the temp dir; its entries name Arrow files in
    flytekit's sandbox under the temp dir, and a test's cache key (its ``tmp_path`` among the inputs) can come
    round again once the temp dir is wiped and pytest's numbering restarts: the hit then names a file that is
    gone. A session-private cache keeps tests from reading (or filling) the user's."""
    global _FLYTE_CACHE
    try:
        from flytekit.core import local_cache
    except ImportError:  # the GPU machine runs library tests without flytekit
        return
    _FLYTE_CACHE = tempfile.mkdtemp(prefix="unirl-test-flyte-cache-")
    local_cache.CACHE_LOCATION = _FLYTE_CACHE
    local_cache.LocalTaskCache._initialized = False


def pytest_unconfigure(config):
    if _FLYTE_CACHE is not None:
        shutil.rmtree(_FLYTE_CACHE, ignore_errors=True)
