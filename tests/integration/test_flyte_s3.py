"""The grpo workflow with checkpoints, the run report and flytekit's raw outputs on a real S3 server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import s3fs

from tests.flyte.conftest import tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_grpo_checkpoints_report_and_raw_outputs_on_s3(s3_endpoint, s3_bucket):
    name = f"s3-{uuid.uuid4().hex[:8]}"
    opts = s3_endpoint.storage_options
    overrides = tiny_overrides("tiny-grpo", f"{s3_bucket}/ckpts", name, steps=2)
    overrides.append("checkpoint.storage_options=" + json.dumps(opts))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLYTE_AWS_ENDPOINT": s3_endpoint.endpoint,
           "FLYTE_AWS_ACCESS_KEY_ID": s3_endpoint.key, "FLYTE_AWS_SECRET_ACCESS_KEY": s3_endpoint.secret}
    pyflyte = Path(sys.executable).with_name("pyflyte")
    proc = subprocess.run([str(pyflyte), "run", "--raw-output-data-prefix", f"{s3_bucket}/raw", "workflows/grpo.py",
                           "grpo", "--recipe", "tiny-grpo", "--overrides", json.dumps(overrides)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "step 2/2" in out

    fs = s3fs.S3FileSystem(**opts)
    fs.invalidate_cache()
    run = f"{s3_bucket.removeprefix('s3://')}/ckpts/{name}"
    assert json.loads(fs.cat_file(f"{run}/LATEST"))["step"] == 2
    assert fs.exists(f"{run}/step-00000002/manifest.json") and fs.exists(f"{run}/step-00000002/model.safetensors")
    index = fs.cat_file(f"{run}/report/index.html").decode()
    assert index.count("class='step-row'") == 2
    assert fs.exists(f"{run}/report/step-00000001/rewards.csv")
    # flytekit put the Arrow batches between tasks under the raw output prefix
    raw = [p for p in fs.find(f"{s3_bucket.removeprefix('s3://')}/raw") if p.endswith("batch.arrow")]
    assert len(raw) >= 6, raw  # per step: a rollout shard, the joined, scored and advantaged batches
