import pytest
import torch

from unirl_core.errors import NumericsError
from unirl_core.rollout.sigma_verify import sigma_verify, verify_batch_sigmas
from unirl_core.sde import flow_sigmas, shift_sigmas
from unirl_core.types import DiffusionSamplingParams, DiffusionSegment, PromptRecord, SampleBatch

PINNED = flow_sigmas(num_steps=10, shift=3.0)


def test_exact_echo_passes():
    sigma_verify(PINNED, torch.tensor(PINNED, dtype=torch.float32))
    sigma_verify(PINNED, list(PINNED))


def test_reshifted_schedule_is_caught():
    # what diffusers does to custom sigmas passed to set_timesteps: shift them again
    twice = shift_sigmas(torch.tensor(PINNED, dtype=torch.float64), 3.0).float()
    with pytest.raises(NumericsError, match="differs"):
        sigma_verify(PINNED, twice)
    other = torch.tensor(flow_sigmas(num_steps=10, shift=2.9))
    with pytest.raises(NumericsError, match="verbatim"):
        sigma_verify(PINNED, other)


def test_truncated_and_missing_echo_are_caught():
    with pytest.raises(NumericsError, match="truncated"):
        sigma_verify(PINNED, torch.tensor(PINNED[:-1]))
    with pytest.raises(NumericsError, match="echo"):
        sigma_verify(PINNED, None)


def test_bf16_rounded_echo_is_caught():
    with pytest.raises(NumericsError, match="bf16"):
        sigma_verify(PINNED, torch.tensor(PINNED).bfloat16().float())


def test_timestep_scale_is_named():
    with pytest.raises(NumericsError, match="timesteps"):
        sigma_verify(PINNED, torch.tensor(PINNED) * 1000)


def test_batch_check_names_the_sample():
    sp = DiffusionSamplingParams(sigmas=PINNED)
    batch = SampleBatch.from_prompts([PromptRecord(prompt_id="p", prompt="x")], samples_per_prompt=2,
                                     kind="diffusion", sampling=sp)
    with pytest.raises(NumericsError, match=r"sample\[p/0\]"):
        verify_batch_sigmas(batch)
    for i, s in enumerate(batch):
        sig = torch.tensor(PINNED) if i == 0 else torch.tensor(PINNED).bfloat16().float()
        s.generated.segment = DiffusionSegment(latents=torch.zeros(11, 1, 2, 2), log_probs=torch.zeros(10),
                                               sigmas=sig, sde_mask=torch.ones(10, dtype=torch.bool))
    with pytest.raises(NumericsError, match=r"sample\[p/1\]"):
        verify_batch_sigmas(batch)
