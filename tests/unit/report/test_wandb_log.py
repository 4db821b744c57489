"""report.wandb: every step's metrics reach a real W&B run (wandb in offline mode: its own record files, read back
here with the record format's reader below), one run id across resumed writers; bad config names the field."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import wandb  # noqa: F401 - the tracking extra: scripts/install.sh installs it, so its absence fails here

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local

REPO = Path(__file__).resolve().parents[3]


def _records(path: str):
    """Decode a W&B run file: a 7-byte header (":W&B", magic, version), then LevelDB-log-style records in 32 KiB
    blocks (crc32c 4 bytes, length 2 LE, type 1: full / first / middle / last) holding protobuf ``Record``s."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def _finished_records(path: str, timeout: float = 60.0) -> list:
    """The file's records once W&B's writer (its own service process, which flushes after ``finish()``
    returns) has written the run's ``exit`` record."""
    deadline = time.monotonic() + timeout
    while True:
        recs = list(_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def _history(run_dir: Path, run_id: str) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    files = glob.glob(str(run_dir / "writer-*" / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    assert files, f"no offline W&B run files for {run_id} under {run_dir}"
    for f in files:
        for rec in _finished_records(f):
            if rec.WhichOneof("record_type") == "history":
                item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                steps.setdefault(int(item["_step"]), {}).update(item)
    return steps


def _cfg(tmp_path: Path, *extra: str):
    return load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path / 'ckpt'}", "loop.total_steps=2",
                                     "report.tensorboard=false", "report.wandb.project=unirl-test",
                                     "report.wandb.mode=offline", f"report.wandb.dir={tmp_path}", *extra])


@pytest.mark.slow
def test_run_local_logs_every_step_to_one_wandb_run(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path)
    history = run_local(cfg, progress=False)
    logged = _history(tmp_path, cfg.name)
    assert sorted(logged) == [1, 2]
    for step, metrics in enumerate(history, start=1):
        assert logged[step]["reward/mean"] == pytest.approx(metrics["reward/mean"], rel=0, abs=1e-12)
        assert logged[step]["train/loss"] == pytest.approx(metrics["train/loss"], rel=0, abs=1e-12)
    # A resumed run continues the same W&B run id with the next steps.
    more = run_local(_cfg(tmp_path, "loop.total_steps=3"), progress=False)
    logged = _history(tmp_path, cfg.name)
    assert sorted(logged) == [1, 2, 3] and logged[3]["reward/mean"] == pytest.approx(more[-1]["reward/mean"])


@pytest.mark.slow
def test_report_task_writer_resumes_the_run_id_and_links_the_execution(tmp_path, monkeypatch):
    from tasks.report import write_wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("FLYTE_EXECUTION_URL", "https://flyte.example/console/projects/p/domains/d/executions/e1")
    cfg = _cfg(tmp_path, "report.wandb.run_id=exec-e1")
    for step in (1, 2):  # two report tasks (two pods on a cluster): two writers, one run id
        assert write_wandb(cfg, step, {"reward/mean": 0.1 * step, "step": step, "flag": True}) is None  # offline
    logged = _history(tmp_path, "exec-e1")
    assert sorted(logged) == [1, 2] and logged[2]["reward/mean"] == pytest.approx(0.2)
    assert "flag" not in logged[1] and "step" not in logged[1]  # booleans and the x axis are no metrics
    files = glob.glob(str(tmp_path / "writer-*" / "wandb" / "offline-run-*-exec-e1" / "*.wandb"))
    assert len(files) == 2  # one per writer, none clobbered
    runs = [r for f in files
            for r in _finished_records(f)
            if r.WhichOneof("record_type") == "run"]
    assert runs and all("executions/e1" in r.run.notes for r in runs)


def test_bad_wandb_config_names_the_field():
    for over, field in ((["report.wandb.project=p", "report.wandb.mode=cloud"], "report.wandb.mode"),
                        (["report.wandb.project=p", "report.wandb.run_id=a/b"], "report.wandb.run_id")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_recipe("tiny-grpo", over)


@pytest.mark.slow
def test_no_wandb_section_never_imports_wandb(tmp_path):
    code = ("import sys; import unirl_core.loop.local, unirl_core.config; "
            "print('wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert out.stdout.strip() == "False"


def test_unset_fields_follow_the_environment_and_the_recipe_wins():
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "env-project", "WANDB_ENTITY": "team", "WANDB_DIR": "/w"}
    cfg = load_recipe("tiny-grpo", ["report.wandb={}"]).report.wandb
    assert cfg.resolved(env) == {"project": "env-project", "entity": "team", "mode": "offline", "group": None,
                                 "dir": "/w"}
    explicit = load_recipe("tiny-grpo", ["report.wandb={project: p, mode: online}"]).report.wandb
    assert explicit.resolved(env)["mode"] == "online" and explicit.resolved(env)["project"] == "p"
    assert explicit.resolved({})["mode"] == "online"  # neither: wandb's default
    with pytest.raises(ConfigError, match=r"report\.wandb\.project.*WANDB_PROJECT"):
        cfg.resolved({"WANDB_MODE": "offline"})


@pytest.mark.slow
def test_wandb_mode_offline_in_the_environment_runs_without_an_api_key(tmp_path, monkeypatch):
    """The issue's failure: a recipe with report.wandb but no mode, a pod with WANDB_MODE=offline and no API key.
    wandb writes an offline run (no network) under WANDB_DIR, in WANDB_PROJECT."""
    from tasks.report import write_wandb

    for k in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path / 'ckpt'}", "report.wandb={run_id: env-run}"])
    assert cfg.report.wandb.mode is None and cfg.report.wandb.project is None
    assert write_wandb(cfg, 1, {"reward/mean": 0.25}) is None  # offline: no URL
    logged = _history(tmp_path, "env-run")
    assert logged[1]["reward/mean"] == pytest.approx(0.25)
    files = glob.glob(str(tmp_path / "writer-*" / "wandb" / "offline-run-*-env-run" / "*.wandb"))
    runs = [r for f in files for r in _finished_records(f) if r.WhichOneof("record_type") == "run"]
    assert runs and all(r.run.project == "from-env" for r in runs)
