"""The run lease on a real S3 server (Ceph RGW): conditional PUTs elect one writer between processes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.unit.checkpoint.test_lease import child, elsewhere, wait_line
from unirl_core.checkpoint.lease import LeaseConfig, LeaseHeld, LeaseLost, RunLease

pytestmark = pytest.mark.integration


def test_processes_race_refuse_and_take_over_on_s3(s3_endpoint, s3_bucket):
    options = s3_endpoint.storage_options
    root = f"{s3_bucket}/ckpts"
    procs = [child(root, "run", "try", options=options) for _ in range(4)]  # If-None-Match: one creates it
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs.count("WON") == 1, outs
    winner = procs[outs.index("WON")].pid
    assert all(o == f"LOST {winner}" for o in outs if o != "WON"), outs

    # the winner exited without releasing: dead on this host, so the next holder takes over (If-Match)
    holder = child(root, "run", "hold", 300.0, options=options)
    wait_line(holder, "HELD")
    lease = RunLease(root, "run", storage_options=options)
    with pytest.raises(LeaseHeld, match=f"pid {holder.pid}"):
        lease.acquire()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    lease.acquire()
    assert lease.holder_record().holder.pid == os.getpid()
    lease.release()
    assert lease.holder_record().released


def test_expired_holder_loses_the_lease_on_s3(s3_endpoint, s3_bucket):
    options = s3_endpoint.storage_options
    old = RunLease(s3_bucket, "run", LeaseConfig(ttl_s=0.5), storage_options=options, holder=elsewhere())
    old.acquire()
    time.sleep(0.7)
    new = RunLease(s3_bucket, "run", storage_options=options)
    new.acquire()
    with pytest.raises(LeaseLost):
        old.renew()
    assert new.holder_record().holder.pid == os.getpid()
