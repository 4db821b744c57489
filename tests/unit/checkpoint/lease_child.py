"""A separate process that takes a run's lease (tests/unit/checkpoint/test_lease.py, the S3 integration test).

    python lease_child.py <root> <run> <mode> [hold_seconds] [storage_options json]

mode ``hold``: keep the lease (heartbeat thread) for hold_seconds, printing ``HELD`` once it is taken, then release;
``try``: one acquire attempt, printing ``WON`` or ``LOST <holder pid>``; ``acquire``: ``acquire()`` with the default
config, printing ``WON`` or the LeaseHeld message.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from unirl_core.checkpoint.lease import LeaseConfig, LeaseHeld, RunLease


def main() -> None:
    root, run, mode = sys.argv[1:4]
    hold = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    lease = RunLease(root, run, LeaseConfig(ttl_s=60.0), storage_options=options)
    if mode == "hold":
        with lease.kept():
            print("HELD", flush=True)
            time.sleep(hold)
    elif mode == "try":
        other = lease.try_acquire()
        print("WON" if other is None else f"LOST {other.holder.pid}", flush=True)
    elif mode == "acquire":
        try:
            lease.acquire()
            print("WON", flush=True)
        except LeaseHeld as e:
            print(f"HELD-BY-OTHER {e}", flush=True)


if __name__ == "__main__":
    main()
