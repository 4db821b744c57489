"""HostStaging on a CPU trainer, and the bookkeeping that bounds its pinned memory (the GPU path itself is checked by
``benchmarks/gpu_staging_check.py``: pinned buffers need a CUDA build)."""

import torch

from unirl_core.train.host_staging import HostStaging, wait_all


def test_cpu_tensors_pass_through_and_nothing_is_fenced():
    staging = HostStaging()
    t = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    got = staging.copy("w", t)
    assert torch.equal(got, t) and got.is_contiguous()
    assert staging.fence() == [] and staging.nbytes == 0
    wait_all([])


def test_a_fence_after_copies_frees_the_buffers_of_names_not_staged_again():
    staging = HostStaging()
    # what two versions of different models leave behind (buffers are only allocated for device tensors)
    staging._buffers = {"a": torch.zeros(4), "b": torch.zeros(8)}
    staging._used = {"a"}
    staging.fence()
    assert set(staging._buffers) == {"a"} and staging.nbytes == 16
    staging.fence()  # no copies since the last fence (a full-state version): the buffers stay for the next one
    assert set(staging._buffers) == {"a"}
