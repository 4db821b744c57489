"""Integration fixtures: a real S3 endpoint (Ceph RGW on 127.0.0.1) for checkpoint tests."""

from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "s3_server.sh"


@dataclass(frozen=True)
class S3Endpoint:
    endpoint: str
    key: str
    secret: str
    start_seconds: float
    """Time the fixture spent starting the server (0 when an existing endpoint was reused)."""

    @property
    def storage_options(self) -> dict[str, object]:
        # no region_name in client_kwargs: RGW then rejects bucket creation (InvalidLocationConstraint)
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret}


def _parse_env(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("export ") and "=" in line:
            k, v = line[len("export "):].split("=", 1)
            out[k] = v
    return out


def _script(cmd: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), cmd], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """``UNIRL_S3_ENDPOINT`` (+ AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) when set, else a Ceph RGW started by
    scripts/s3_server.sh for this session (stopped at the end unless it was already running)."""
    if os.environ.get("UNIRL_S3_ENDPOINT"):
        yield S3Endpoint(endpoint=os.environ["UNIRL_S3_ENDPOINT"], key=os.environ["AWS_ACCESS_KEY_ID"],
                         secret=os.environ["AWS_SECRET_ACCESS_KEY"], start_seconds=0.0)
        return
    running = _script("env", timeout=30)
    started_here = running.returncode != 0
    t0 = time.perf_counter()
    proc = _script("start", timeout=900) if started_here else running
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/s3_server.sh start failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    seconds = time.perf_counter() - t0 if started_here else 0.0
    env = _parse_env(proc.stdout)
    log.warning("S3 endpoint %s (%s, %.1f s)", env["UNIRL_S3_ENDPOINT"],
                "started" if started_here else "reused", seconds)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # child processes (crash tests) and env-configured s3fs see the endpoint
    try:
        yield S3Endpoint(endpoint=env["UNIRL_S3_ENDPOINT"], key=env["AWS_ACCESS_KEY_ID"],
                         secret=env["AWS_SECRET_ACCESS_KEY"], start_seconds=seconds)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if started_here:
            _script("stop", timeout=120)


@pytest.fixture
def s3_bucket(s3_endpoint: S3Endpoint) -> Iterator[str]:
    """A fresh bucket URL (``s3://unirl-test-<hex>``), deleted with its objects afterwards."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_endpoint.storage_options)
    name = f"unirl-test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    yield f"s3://{name}"
    fs.invalidate_cache()
    fs.rm(name, recursive=True)
