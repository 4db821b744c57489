"""The resume line an interrupted local `pyflyte run` prints (tasks/common.py)."""

from tasks.common import pyflyte_resume_command


def test_pyflyte_resume_command():
    cmd = pyflyte_resume_command(
        [".venv/bin/pyflyte", "run", "workflows/grpo.py", "grpo", "--recipe", "tiny-grpo", "--overrides",
         '["loop.total_steps=20", "train.lr=1e-3"]', "--resume", "runs/x/step-00000003"], env={})
    assert cmd == (".venv/bin/pyflyte run workflows/grpo.py grpo --recipe tiny-grpo --overrides "
                   "'[\"loop.total_steps=20\", \"train.lr=1e-3\"]' --resume latest")
    fork = ["pyflyte", "run", "workflows/grpo.py", "grpo", "--resume=runs/x/step-00000003", "--fork_as", "y"]
    assert pyflyte_resume_command(fork, env={"OMP_NUM_THREADS": "1", "HOME": "/h"}) == \
        "OMP_NUM_THREADS=1 pyflyte run workflows/grpo.py grpo --resume=runs/x/step-00000003 --fork_as y"
    assert pyflyte_resume_command(["pytest", "-q"]) is None
    assert pyflyte_resume_command(["pyflyte", "run", "--remote", "workflows/grpo.py", "grpo"]) is None
