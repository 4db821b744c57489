"""Each role ImageSpec (``images/specs.py``) holds what its pods import and run: a virtual environment built from
exactly the packages the spec declares (pip resolves them, held to ``constraints.txt``), in which the modules
holding that role's tasks are imported as its pod imports them and one tiny step of the role's work runs
(``role_image_check.py``). A package missing from a spec fails here instead of in a pod on the cluster.

The one substitution, checked below (``HOST_SUBSTITUTES``): the spec's extra index (PyTorch's CUDA 12.8 wheels, a
multi-GB download of a GPU build) is not used; pip takes ``torch`` of the spec's release from this machine's own
configuration (the CPU build). Everything else is the spec's list: ``onnxruntime-gpu`` installs here and its CPU
provider runs the OCR model. The apt packages (``libgl1``, ``libglib2.0-0``) and the CUDA base image are not
installed by this test: the host's system libraries stand in for them.

Marked ``integration``: pip reaches the package index (a cold cache downloads ~2 GB), and it is long: 341-434 s wall
for the module (rollout's venv 160-260 s of it; ~150-165 s of CPU) on the 2-core box under a load of ~10, pip's cache
warm (2026-12-06).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from images.specs import PYTHON, TORCH_INDEX, reward_image, rollout_image, train_image

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).with_name("role_image_check.py")
SPECS = {"rollout": rollout_image, "reward": reward_image, "train": train_image}
HOST_SUBSTITUTES = {"pip_extra_index_url": [TORCH_INDEX]}
"""Spec settings this test does not apply, and why (module docstring): the CUDA wheel index."""
CLI_ONLY = {"workflows.flyte_plugin", "workflows.remote_check"}
"""pyflyte's plugin and the config check: they run where pyflyte runs, never in a pod."""


def _role_modules(role: str) -> list[str]:
    """The modules that hold a task or @dynamic running in ``role``'s image: what its pods import (flytekit's
    default resolver imports the task's own module)."""
    import importlib
    import pkgutil

    from flytekit.core.base_task import PythonTask

    import tasks
    import workflows

    out = []
    for pkg in (tasks, workflows):
        for mod in pkgutil.iter_modules(pkg.__path__):
            if f"{pkg.__name__}.{mod.name}" in CLI_ONLY:
                continue
            m = importlib.import_module(f"{pkg.__name__}.{mod.name}")
            if any(isinstance(v, PythonTask) and getattr(v, "container_image", None) is SPECS[role]
                   and getattr(v, "__module__", m.__name__) == m.__name__ for v in vars(m).values()):
                out.append(m.__name__)
    return out


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the filesystem allows (pip replaces files, never writes into them, and Python writes .pyc
    files by rename: the venvs stay independent), so the three venvs take ~2 GB of disk instead of ~6."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class RoleVenvs:
    """One venv per spec, each with that spec's whole list installed by pip. Rollout's list is a subset of reward's
    and of train's, and constraints.txt pins one version of each package, so reward's and train's venvs start as
    copies of rollout's (hard links) and install their own whole list on top: the same set a fresh install resolves (``pip
    check`` confirms it is consistent), at a fraction of the download and unpack time."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.timings: dict[str, float] = {}

    def _pip(self, path: Path, role: str) -> None:
        python = str(path / "bin" / "python")
        # --no-compile: no .pyc written at install (the imports compile what they load)
        cmd = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", "-c",
               str(REPO / "constraints.txt"), *SPECS[role].packages]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, f"pip install of {SPECS[role].name}'s packages failed:\n{proc.stderr[-4000:]}"
        check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
        assert check.returncode == 0, f"{SPECS[role].name}: pip check:\n{check.stdout}{check.stderr}"

    def get(self, role: str) -> Path:
        t0 = time.perf_counter()
        rollout = self.base / "rollout"
        if not (rollout / "bin" / "python").exists():
            assert set(SPECS["rollout"].packages) <= set(SPECS["reward"].packages) & set(SPECS["train"].packages)
            venv.create(rollout, with_pip=True)
            self._pip(rollout, "rollout")
        path = self.base / role
        if role != "rollout" and not path.exists():
            shutil.copytree(rollout, path, symlinks=True, copy_function=_link_or_copy)
            self._pip(path, role)
        self.timings[role] = time.perf_counter() - t0
        return path / "bin" / "python"


@pytest.fixture(scope="module")
def role_venvs(tmp_path_factory):
    venvs = RoleVenvs(tmp_path_factory.mktemp("role-venvs"))
    yield venvs
    print("role venv install seconds:", {k: round(v, 1) for k, v in venvs.timings.items()})
    shutil.rmtree(venvs.base, ignore_errors=True)  # ~2 GB; pytest keeps its last basetemps


def test_the_specs_differ_from_what_is_installed_here_only_by_the_documented_substitutes():
    for spec in SPECS.values():
        assert spec.pip_extra_index_url == HOST_SUBSTITUTES["pip_extra_index_url"], spec.name
        assert spec.python_version == PYTHON
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == PYTHON, \
        f"the specs build Python {PYTHON} images; this interpreter is {sys.version}"


@pytest.mark.parametrize("role", ["rollout", "reward", "train"])
def test_role_image_imports_its_tasks_and_runs_a_tiny_step(role, role_venvs, tmp_path):
    modules = _role_modules(role)
    assert modules, f"no task runs in {SPECS[role].name}"
    python = role_venvs.get(role)
    pinned = next(p for p in SPECS[role].packages if p.startswith("torch=="))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([str(python), str(CHECK), role, str(tmp_path), *modules], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=900)
    print(f"{role}: modules {modules}; check {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0 and proc.stdout.strip().endswith(f"ok {role}"), \
        f"{SPECS[role].name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    torch_version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    assert torch_version.split("+")[0] == pinned.removeprefix("torch==")
