"""The README's main command, `pyflyte run workflows/grpo.py grpo`, as a user runs it (one step, temp root)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pyflyte_run_grpo_prints_progress(tmp_path):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    overrides = json.dumps(["loop.total_steps=2", f"checkpoint.root={tmp_path}", f"name={name}"])
    pyflyte = Path(sys.executable).with_name("pyflyte")
    proc = subprocess.run([str(pyflyte), "run", "workflows/grpo.py", "grpo", "--overrides", overrides], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = re.findall(r"INFO unirl\.progress: (step \d+/\d+ \| reward \S+ \| ratio \S+ \| step \S+ \| ETA \S+)", out)
    assert [ln.split(" |")[0] for ln in lines] == ["step 1/2", "step 2/2"], out[-4000:]
    assert "step-00000002" in out and (tmp_path / name / "report" / "index.html").is_file()
