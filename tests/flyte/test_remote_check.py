"""`python -m workflows.remote_check`: one line saying what to configure before `pyflyte run --remote`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FLYTE", "FLYTECTL"))}
    base.update(HOME=str(tmp_path), PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-m", "workflows.remote_check", "--timeout", "2"], cwd=tmp_path, env=base,
                          capture_output=True, text=True, timeout=60, check=False)


def _lines(p: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]


def _config(tmp_path: Path, port: int) -> str:
    path = tmp_path / "flyte.yaml"
    path.write_text(f"admin:\n  endpoint: dns:///127.0.0.1:{port}\n  insecure: true\n")
    return str(path)


def test_no_config_one_line(tmp_path):
    p = _run(tmp_path)
    assert p.returncode == 1
    assert len(_lines(p)) == 1 and "no Flyte config found" in p.stderr and "~/.flyte/config.yaml" in p.stderr


def test_unreachable_endpoint_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _run(tmp_path, FLYTECTL_CONFIG=_config(tmp_path, port))
    assert p.returncode == 1 and len(_lines(p)) == 1
    assert f"admin.endpoint='127.0.0.1:{port}' is not reachable" in p.stderr


def test_reachable_endpoint(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        p = _run(tmp_path, FLYTECTL_CONFIG=_config(tmp_path, s.getsockname()[1]))
    assert p.returncode == 0 and p.stdout.startswith("ok: ") and len(_lines(p)) == 1


def _pyflyte_remote(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The real ``pyflyte run --remote`` (our flytekit plugin is registered by the project's install)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FLYTE", "FLYTECTL", "UNIRL_REMOTE"))}
    base.update(HOME=str(tmp_path), COLUMNS="200", **env)
    pyflyte = Path(sys.executable).with_name("pyflyte")
    return subprocess.run([str(pyflyte), "run", "--remote", str(REPO / "workflows" / "grpo.py"), "grpo",
                           "--recipe", "tiny-grpo"], cwd=tmp_path, env=base, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.slow
def test_pyflyte_remote_without_config_fails_in_one_message(tmp_path):
    p = _pyflyte_remote(tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "unirl: no Flyte config found" in out and "Traceback" not in out and "signed" not in out.lower()
    assert len(_lines(p)) <= 6, out  # one message (rich draws a box around it), not flytekit's ~280 lines


@pytest.mark.slow
def test_pyflyte_remote_unreachable_endpoint_names_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _pyflyte_remote(tmp_path, FLYTECTL_CONFIG=_config(tmp_path, port))
    out = p.stdout + p.stderr
    assert p.returncode != 0 and f"127.0.0.1:{port}" in out and "is not reachable" in out and "Traceback" not in out


@pytest.mark.slow
def test_local_pyflyte_run_is_not_checked(tmp_path):
    """Without --remote, pyflyte still asks the plugin for a remote (no upload location): no check, the run runs."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FLYTE", "FLYTECTL", "UNIRL_REMOTE"))}
    base.update(HOME=str(tmp_path), OMP_NUM_THREADS="1")
    pyflyte = Path(sys.executable).with_name("pyflyte")
    root = tmp_path / "runs"
    p = subprocess.run([str(pyflyte), "run", str(REPO / "workflows" / "grpo.py"), "grpo", "--recipe", "tiny-grpo",
                        "--overrides", f'["loop.total_steps=1", "checkpoint.root={root}"]'],
                       cwd=tmp_path, env=base, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "unirl: no Flyte config" not in p.stdout + p.stderr
    assert (tmp_path / "runs" / "tiny-grpo" / "LATEST").exists()
