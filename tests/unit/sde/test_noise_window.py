import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unirl_core.errors import ConfigError
from unirl_core.sde import flow_sigmas, group_seed, initial_noise, sde_step_mask, select_train_steps, sibling_indices
from unirl_core.types import DiffusionSamplingParams, NoiseRecipe

_GROUPS = ["p0", "p1", "p0", "p1", "p0"]
_SNIPPET = (
    "import hashlib, torch; torch.set_num_threads(1)\n"
    "from unirl_core.sde import initial_noise\nfrom unirl_core.types import NoiseRecipe\n"
    "x = initial_noise(NoiseRecipe(base_seed=7), ['p0', 'p1', 'p0', 'p1', 'p0'], (4, 8, 8))\n"
    "print(hashlib.sha256(x.numpy().tobytes()).hexdigest())\n"
)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.mark.slow
def test_initial_noise_identical_bytes_across_processes():
    here = _digest(initial_noise(NoiseRecipe(base_seed=7), _GROUPS, (4, 8, 8)))
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _SNIPPET], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_sibling_noise_independent_of_batch_layout():
    recipe = NoiseRecipe(base_seed=3)
    full = initial_noise(recipe, _GROUPS, (2, 4, 4))
    assert sibling_indices(_GROUPS) == [0, 0, 1, 1, 2]
    # the third sibling of p0 alone, addressed by its index
    alone = initial_noise(recipe, ["p0"], (2, 4, 4), sibling_index=[2])
    assert torch.equal(alone[0], full[4])
    assert not torch.equal(full[0], full[2])
    assert full.dtype == torch.float32
    assert group_seed(3, "p0") != group_seed(3, "p1") and group_seed(3, "p0") != group_seed(4, "p0")


def test_same_noise_per_group():
    x = initial_noise(NoiseRecipe(base_seed=3, same_noise_per_group=True), _GROUPS, (2, 4, 4))
    assert torch.equal(x[0], x[2]) and torch.equal(x[0], x[4]) and not torch.equal(x[0], x[1])


def _params(**kw):
    return DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=10), **kw)


def test_sde_mask_all_steps_and_deterministic_kernels():
    assert bool(sde_step_mask(_params()).all())
    assert not bool(sde_step_mask(_params(sde_type="ode")).any())
    assert not bool(sde_step_mask(_params(noise_level=0.0)).any())
    cps = sde_step_mask(_params(sde_type="cps"))
    assert bool(cps[:-1].all()) and not bool(cps[-1])


def test_sde_window_lies_in_range_and_varies():
    starts = set()
    for seed in range(40):
        m = sde_step_mask(_params(sde_window_size=2, sde_window_range=(2, 6)), generator=torch.Generator().manual_seed(seed))
        idx = torch.nonzero(m).flatten().tolist()
        assert len(idx) == 2 and idx[1] == idx[0] + 1 and 2 <= idx[0] <= 5
        starts.add(idx[0])
    assert starts == {2, 3, 4, 5}


def test_select_train_steps_fraction_is_reproducible():
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 1:4] = True
    mask[1, 5:9] = True
    assert select_train_steps(mask, fraction=1.0) == [1, 2, 3, 5, 6, 7, 8]
    a = select_train_steps(mask, fraction=0.5, generator=torch.Generator().manual_seed(1))
    b = select_train_steps(mask, fraction=0.5, generator=torch.Generator().manual_seed(1))
    assert a == b and len(a) == 4 and set(a) <= {1, 2, 3, 5, 6, 7, 8}
    with pytest.raises(ConfigError):
        select_train_steps(mask, fraction=0.0)
