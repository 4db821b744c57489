import numpy as np
import pytest
from diffusers import FlowMatchEulerDiscreteScheduler

from unirl_core.errors import ConfigError
from unirl_core.sde import dynamic_shift_mu, flow_sigmas, flux_sigmas, sigmas_tensor
from unirl_core.types import DiffusionSamplingParams, as_float32_tuple


@pytest.mark.parametrize("steps", [1, 2, 10, 28, 40])
@pytest.mark.parametrize("shift", [1.0, 3.0, 2.5])
def test_flow_sigmas_match_diffusers_bitwise(steps, shift):
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    assert flow_sigmas(num_steps=steps, shift=shift) == tuple(sched.sigmas.tolist())


@pytest.mark.parametrize("steps", [4, 28])
@pytest.mark.parametrize("seq_len", [16, 1024, 4096])
def test_flux_sigmas_match_diffusers_dynamic_shift(steps, seq_len):
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=dynamic_shift_mu(seq_len))
    assert flux_sigmas(num_steps=steps, image_seq_len=seq_len) == tuple(sched.sigmas.tolist())


def test_schedule_is_pinnable_and_float32_exact():
    sig = flow_sigmas(num_steps=10)
    assert len(sig) == 11 and sig[0] == 1.0 and sig[-1] == 0.0
    assert as_float32_tuple(sig) == sig
    params = DiffusionSamplingParams(sigmas=sig)
    assert params.num_steps == 10
    assert tuple(sigmas_tensor(sig).tolist()) == sig


def test_bad_arguments():
    with pytest.raises(ConfigError, match="num_steps"):
        flow_sigmas(num_steps=0)
    with pytest.raises(ConfigError, match="shift"):
        flow_sigmas(num_steps=4, shift=0.0)
    with pytest.raises(ConfigError, match="image_seq_len"):
        flux_sigmas(num_steps=4, image_seq_len=0)
