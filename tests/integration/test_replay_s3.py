"""Replay and re-score a run whose store is S3 (a real Ceph RGW on 127.0.0.1): batches are uploaded and read back,
the replayed version is written under the run's replay/ prefix and removed."""

from __future__ import annotations

import json

import pytest
import s3fs

from unirl_core.checkpoint.batches import BatchStore
from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local
from unirl_core.runs.replay import ReplayMismatch, replay
from unirl_core.runs.rescore import alternative, rescore

pytestmark = pytest.mark.integration

SMALL = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
         "lm.engine.forward_batch_size=8", "loop.total_steps=3", "checkpoint.keep_batches=true",
         "checkpoint.keep_every=1", "report.tensorboard=false"]


def test_replay_and_rescore_over_s3(s3_endpoint, s3_bucket):
    opts = s3_endpoint.storage_options
    cfg = load_recipe("tiny-grpo", [*SMALL, f"checkpoint.root={s3_bucket}/ckpts",
                                    "checkpoint.storage_options=" + json.dumps(opts)])
    run_local(cfg, progress=False)
    run = f"{s3_bucket}/ckpts/{cfg.name}"
    store = BatchStore(f"{s3_bucket}/ckpts", cfg.name, storage_options=opts)
    assert store.steps() == [1, 2, 3]
    for step in (1, 3):
        assert replay(run, step=step, storage_options=opts).step == step
    fs = s3fs.S3FileSystem(**opts)
    assert not fs.exists(f"{run}/replay")
    table = rescore(run, [alternative("toy_arithmetic")], storage_options=opts)
    assert [r.means["toy_arithmetic"] for r in table.rows] == [r.run for r in table.rows]
    assert fs.exists(f"{run}/rescore/rescore.csv")
    batch = store.load(2)
    batch.samples[0].parts[-1].advantage += 1.0
    store.save(2, batch)
    with pytest.raises(ReplayMismatch, match="field 'advantage'"):
        replay(run, step=2, storage_options=opts)
