"""HostStaging on a CPU trainer, and the bookkeeping that bounds its pinned memory (the GPU path itself is checked by
``benchmarks/gpu_staging_check.py``: pinned buffers need a CUDA build)."""

import torch

from unirl_core.checkpoint.host_staging import HostStaging, wait_all


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


def test_no_pinned_memory_falls_back_to_a_synchronous_copy(monkeypatch, caplog):
    """A tensor taken for a device tensor on a host that cannot page-lock memory (here: a CPU-only build refuses
    pin_memory): the plain copy, logged once, nothing cached; the step goes on."""
    from unirl_core.checkpoint import host_staging

    monkeypatch.setattr(host_staging, "_on_device", lambda t: True)
    staging = HostStaging()
    t = torch.arange(4.0)
    with caplog.at_level("WARNING", logger="unirl_core.checkpoint.host_staging"):
        a, b = staging.copy("a", t), staging.copy("b", t * 2)
    assert torch.equal(a, t) and torch.equal(b, t * 2)
    assert staging.nbytes == 0 and len([r for r in caplog.records if "pinned" in r.message]) == 1
