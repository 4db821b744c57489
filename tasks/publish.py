"""Publish: make a trained version the run's current one (atomic pointer + retention)."""

from __future__ import annotations

import json
from typing import NamedTuple

from flytekit import task

from images import train_image
from tasks.common import CPU_TASK, DECK, SMALL_TIMEOUT, deck, phase
from tasks.run_types import HashedCheckpointRef, use_storage_options
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config import RunConfig
from unirl_core.report.phase_html import publish_html

if train_image.is_container():
    from unirl_core.loop import phases
    from unirl_core.loop.run_init import run_lease


class Published(NamedTuple):
    ckpt: HashedCheckpointRef
    info: str
    """JSON of what was published: uri, step, policy_version, files (bytes, sha256), bytes, time/publish."""


# not cached: publishing moves the run's pointer, a side effect a cache hit would skip
@task(container_image=train_image, **CPU_TASK, retries=3, timeout=SMALL_TIMEOUT, **DECK)
def publish_task(cfg: RunConfig, ckpt: CheckpointRef) -> Published:
    timings: dict[str, float] = {}
    run_lease(cfg).renew()  # the run's heartbeat; raises when another execution took the run over
    with phase("publish", timings):
        info = phases.publish_phase(cfg, ckpt)
    info.update(timings)
    deck("publish", publish_html(info))
    use_storage_options(cfg)
    return Published(ckpt=ckpt, info=json.dumps(info, sort_keys=True))


@task(container_image=train_image, **CPU_TASK, retries=3, timeout=SMALL_TIMEOUT)
def release_task(cfg: RunConfig, ckpt: CheckpointRef) -> HashedCheckpointRef:
    """The execution's last task: release the run's lease (``init_task`` took it) so the next execution (a
    schedule's) may write the run; returns ``ckpt``. A failed execution releases nothing: its lease goes stale
    after ``checkpoint.lease.ttl_s``."""
    run_lease(cfg).release()
    use_storage_options(cfg)
    return ckpt
