"""The recipe-shape GRPO benchmark runs its CPU path end to end (the GPU run uses the same code with --device cuda)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_preset_runs_every_side_and_writes_json(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_grpo_recipe.py"), "--preset", "tiny", "--steps", "3",
           "--warmup", "1", "--rounds", "1", "--full-state-every", "3", "--results", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median pair ratio" in proc.stdout
    record = json.loads((tmp_path / "grpo_recipe_tiny_cpu" / "latest.json").read_text())
    cell = record["cells"]["full-every-3"]
    assert len(cell["commit"]) == 40 and cell["date"] and cell["env"]["cpu"]
    assert "| loop |" in (tmp_path / "grpo_recipe_tiny_cpu" / "latest.md").read_text()
    out = cell["results"]
    rows = {r["side"]: r for r in out["rows"]}
    assert set(rows) == {"loop", "backend", "trl"}
    # steps 2..4 after the warm-up; steps 3 (every 3rd) and 4 (the run's last) also write the full state: the loop's
    # median and pairs are over step 2 only, those two reported apart; the backend side writes nothing
    assert out["runs"]["loop"][0]["full_state"] == [False, True, True]
    assert rows["loop"]["full_state_steps"] == 2 and rows["loop"]["full_state_step_s"] > 0
    assert rows["loop"]["median_step_s"] == out["runs"]["loop"][0]["times"][0]
    assert "full resumable state" in proc.stdout
    for side, pairs in (("loop", 1), ("backend", 3)):
        r = rows[side]
        assert r["rounds_ok"] == 1 and r["pairs"] == pairs and r["median_pair_ratio_vs_trl"] > 0
        assert r["ratio_max_dev"] == 0.0  # first update exact on both of our sides
        assert r["peak_mib"] > 0 and r["completion_len_mean"] > 0
    assert rows["trl"]["rounds_ok"] == 1 and len(out["runs"]["trl"][0]["times"]) == 3
    assert "time/train" in rows["loop"]["phases"]
