"""What a save/load round trip of a model guarantees, as test helpers.

Guaranteed bitwise: the weights. Every parameter and buffer of the loaded module equals the saved one bit
for bit (safetensors and ``state_dict`` store and copy the exact bits).

Not guaranteed bitwise: the outputs of two separately built module instances, even with bitwise-equal
weights. CPU kernels (oneDNN/MKL/OpenBLAS) may take different code paths for the same math, e.g. depending
on the memory alignment of the tensors. Measured on an AMD EPYC: between a pipeline loaded with
from_pretrained and the preset it was saved from, the tiny SD3 velocity differs by up to 4.8e-7 and the
tiny Flux one by 2.4e-7 (fp32, values of magnitude ~2), where the CPU these tests were first written on
gave bitwise-equal outputs. The loaded parameters there sit at addresses that are not 64-byte aligned (the
preset's all are); cloning them into fresh storage made the outputs bitwise equal again, so the cause is
kernel choice, not the weights. Outputs are therefore compared within ``OUTPUT_ATOL`` (fp32; about 20x the
measured difference). The bitwise weight check is what catches a wrong or missing weight; the output check
guards the rest of the load path (config, dtype, how the parts are wired).

This is about two module instances. The same module object replaying the same inputs (rollout vs replay,
the GRPO ratio of exactly 1.0) is bitwise by design and is tested as such elsewhere.
"""

import torch
from torch import nn

OUTPUT_ATOL = 1e-5


def assert_same_weights(loaded: nn.Module, original: nn.Module, *, skip: str | None = None, what: str = "") -> None:
    """Every parameter and buffer of ``loaded`` is bitwise equal (same names, dtypes, values) to ``original``'s.

    ``skip``: leave out names containing this substring (e.g. LoRA adapters attached after loading).
    """
    for kind in ("named_parameters", "named_buffers"):
        a = {k: v for k, v in getattr(loaded, kind)() if skip is None or skip not in k}
        b = {k: v for k, v in getattr(original, kind)() if skip is None or skip not in k}
        assert a.keys() == b.keys(), (what, kind, sorted(a.keys() ^ b.keys())[:5])
        differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
        assert not differ, (what, kind, differ[:5])


def assert_outputs_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Outputs of two module instances with bitwise-equal weights: equal up to kernel choice (see above)."""
    assert got.dtype == want.dtype == torch.float32, (got.dtype, want.dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=OUTPUT_ATOL)
