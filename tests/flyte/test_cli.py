"""The README's main command, `pyflyte run workflows/grpo.py grpo`, as a user runs it (one step, temp root)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_help_lists_the_recipes_and_the_override_syntax():
    """``--help`` names every recipe (the library's and the plugins') and shows the overrides' form by example."""
    from unirl_core.config.recipes import recipe_names

    pyflyte = Path(sys.executable).with_name("pyflyte")
    proc = subprocess.run([str(pyflyte), "run", "workflows/grpo.py", "grpo", "--help"], cwd=REPO,
                          env={**os.environ, "COLUMNS": "400"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = recipe_names()
    assert {"tiny-grpo", "shapes-flow-grpo-count", "tiny-agent-calc"} <= set(names)
    assert all(re.search(rf"[ ,]{re.escape(n)}[,.]", proc.stdout) for n in names), proc.stdout
    assert """--overrides '["loop.total_steps=4"]'""" in proc.stdout


def _pyflyte(*args: str, **env: str) -> subprocess.CompletedProcess:
    pyflyte = Path(sys.executable).with_name("pyflyte")
    return subprocess.run([str(pyflyte), *args], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_bad_input_is_one_message_and_a_flag_shows_the_traceback(tmp_path):
    """A recipe typo, a refused override or broken YAML: the library's message alone (naming the field, the value
    and the fix), exit 1; UNIRL_TRACEBACK=1 (or pyflyte -v) prints flytekit's traceback as before."""
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: x\nfamily: lm\n  bad: [\n")
    for args, want in ((["--recipe", "tiny-grpoo"], r"recipe='tiny-grpoo': expected a shipped recipe"),
                       (["--recipe", "tiny-grpo", "--overrides", '["train.lrr=1"]'],
                        r"recipe\.train\.lrr=1: expected a field of TrainConfig"),
                       (["--recipe", str(bad_yaml)], r"recipe bad\.yaml: not valid YAML")):
        proc = _pyflyte("run", "workflows/grpo.py", "grpo", *args)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-3000:]
        assert re.search(r"ConfigError in tasks\.setup\.setup_task: " + want, out), out[-3000:]
        assert "Traceback" not in out and len(out.splitlines()) <= 12, out
    traced = _pyflyte("run", "workflows/grpo.py", "grpo", "--recipe", "tiny-grpoo", UNIRL_TRACEBACK="1")
    assert traced.returncode == 1 and len((traced.stdout + traced.stderr).splitlines()) > 30


@pytest.mark.slow
def test_non_json_overrides_show_the_form_by_example():
    proc = _pyflyte("run", "workflows/grpo.py", "grpo", "--overrides", "loop.total_steps=2", COLUMNS="300")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert """a JSON list of "a.b=value" strings, e.g. --overrides '["loop.total_steps=4", "train.lr=1e-4"]'""" in \
        " ".join((proc.stdout + proc.stderr).split()).replace("│ ", "").replace(" │", "")


@pytest.mark.slow
def test_pyflyte_run_grpo_prints_progress(tmp_path):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    overrides = json.dumps(["loop.total_steps=2", f"checkpoint.root={tmp_path}", f"name={name}"])
    pyflyte = Path(sys.executable).with_name("pyflyte")
    proc = subprocess.run([str(pyflyte), "run", "workflows/grpo.py", "grpo", "--overrides", overrides], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # The default recipe (shapes-flow-grpo-count, Flow-GRPO) prints its ratio, exactly 1 (one on-policy update a
    # batch, pi_old = the log-probs stored at rollout), and evaluates at the end of the run.
    lines = re.findall(r"INFO unirl\.progress: (step \d+/\d+ \| reward \S+ \| (?:ratio \S+ \| )?(?:eval \S+ \| )?"
                       r"step \S+ \| ETA \S+)", out)
    assert [ln.split(" |")[0] for ln in lines] == ["step 1/2", "step 2/2"], out[-4000:]
    assert all("| ratio 1.0000 |" in ln for ln in lines) and "eval " in lines[-1], lines
    assert "step-00000002" in out and (tmp_path / name / "report" / "index.html").is_file()
    # the end of the run says where it wrote what
    assert f"report:      {tmp_path}/{name}/report/index.html" in out, out[-2000:]
    assert f"tensorboard --logdir {tmp_path}/{name}/tensorboard" in out and "Flyte decks:" in out


@pytest.mark.slow
def test_ctrl_c_prints_the_last_published_version_and_a_working_resume_command(tmp_path):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    overrides = json.dumps(["loop.total_steps=400", f"checkpoint.root={tmp_path}", f"name={name}"])
    pyflyte = Path(sys.executable).with_name("pyflyte")
    argv = [str(pyflyte), "run", "workflows/grpo.py", "grpo", "--recipe", "tiny-grpo", "--overrides", overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while "step 3/400" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
            # flytekit's local runner sometimes swallows one SIGINT (seen once under load: the run went on);
            # a user presses Ctrl-C again, so does the test, up to three times
            for _ in range(3):
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=40)
                    break
                except subprocess.TimeoutExpired:
                    continue
            assert proc.poll() is not None, "pyflyte ignored three SIGINTs"
        finally:
            proc.kill()
    text = log.read_text()
    published = json.loads((tmp_path / name / "LATEST").read_text())["step"]
    # the last message counts (a second Ctrl-C prints again, after what was published since)
    found = ([*re.finditer(rf"interrupted: run '{name}' last published step (\d+) \((\S+)\).*Resume with: (.+)",
                           text)] or [None])[-1]
    assert found and int(found[1]) == published, text[-4000:]
    assert found[2] == str(tmp_path / name / f"step-{published:08d}")
    command = shlex.split(found[3])
    assigned = {}  # the thread variables the run ran with, in front of the command (a shell sets them)
    while re.fullmatch(r"[A-Z_]+=\S*", command[0]):
        key, value = command.pop(0).split("=", 1)
        assigned[key] = value
    assert assigned.get("OMP_NUM_THREADS") == "1" and set(assigned) <= {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}
    assert command == [*argv, "--resume", "latest"]
    # the printed command continues the run (one step of it here)
    proc = subprocess.run([*command, "--max_steps", "1"], cwd=REPO, env={**env, **assigned}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"step {published + 1}/400" in proc.stderr and f"step {published + 2}/400" not in proc.stderr
