"""MixGRPO's progressive sliding window (arXiv 2507.21802, Sec. 3), transcribed as

    l(k) = min(s * floor((k - 1) / tau), T - w)        k = training step (1-based)
    SDE steps of step k: [l(k), l(k) + w); ODE elsewhere; only the window is trained.

T denoising steps, w window size, tau shift interval, s stride.
"""

import pytest
import torch

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local
from unirl_core.sde.window import sliding_window_start

torch.set_num_threads(1)


def test_golden_window_starts():
    # T = 10, w = 4, tau = 3, s = 2: 0 for steps 1-3, 2 for 4-6, 4 for 7-9, then capped at T - w = 6
    got = [sliding_window_start(k, num_steps=10, size=4, shift_interval=3, stride=2) for k in range(1, 16)]
    assert got == [0, 0, 0, 2, 2, 2, 4, 4, 4, 6, 6, 6, 6, 6, 6]
    assert [sliding_window_start(k, num_steps=4, size=4, shift_interval=1) for k in (1, 9)] == [0, 0]


@pytest.mark.parametrize("kw, message", [
    ({"size": 11}, r"sampling.sde_window_size=11: expected an integer in \[1, num_steps=10\]"),
    ({"shift_interval": 0}, r"sde_window_shift_interval/stride=\(0, 1\): expected integers >= 1"),
])
def test_bad_schedule(kw, message):
    args = {"num_steps": 10, "size": 4, "shift_interval": 2, "stride": 1, **kw}
    with pytest.raises(ConfigError, match=message):
        sliding_window_start(1, **args)


@pytest.mark.parametrize("override, message", [
    (["diffusion.sampling.sde_window_shift_interval=2"],
     r"diffusion.sampling.sde_window_shift_interval=2: expected a set sde_window_size and no sde_window_range"),
    (["diffusion.sampling.sde_window_shift_interval=2", "diffusion.sampling.sde_window_size=3",
      "diffusion.sampling.sde_window_range=[0, 4]"], r"remove sde_window_range"),
    (["diffusion.sampling.sde_window_shift_interval=2", "diffusion.sampling.sde_window_size=3",
      "diffusion.sampling.sde_window_stride=0"], r"expected integers >= 1"),
])
def test_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny-flow-grpo", override)


@pytest.mark.slow
def test_run_samples_and_trains_exactly_the_window_of_each_step(tmp_path):
    cfg = load_recipe("tiny-flow-grpo", [
        f"checkpoint.root={tmp_path}", "loop.total_steps=3", "report.tensorboard=false",
        "diffusion.sampling.num_steps=4", "diffusion.sampling.sde_window_size=2",
        "diffusion.sampling.sde_window_shift_interval=1", "diffusion.sampling.sde_window_stride=1"])
    masks = []
    hist = run_local(cfg, progress=False, on_step=lambda m, b: masks.append(
        {tuple(p.segment.sde_mask.tolist()) for p in b.generated}))
    # steps 1, 2, 3 -> window starts 0, 1, 2 (= T - w, the last position)
    assert masks == [{(True, True, False, False)}, {(False, True, True, False)}, {(False, False, True, True)}]
    for h in hist:
        assert h["train/trained_steps"] == 2.0  # only the window is trained
        assert h["train/ratio_mean"] == 1.0 and h["train/logp_absdiff_max"] == 0.0
