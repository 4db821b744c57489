"""One compute context per policy: what every forward of a bundle sees, whoever runs it.

A bundle declares one compute dtype (its model dtype). Every forward - the rollout engine's, the
trainer's replay of pi_old, the loss forward, the reference forward, a dedicated engine's agreement
check - sees every parameter as a tensor of that dtype and runs natively in it (no autocast):

- a rollout bundle stores its parameters in the compute dtype already (nothing to do);
- a trainer keeps fp32 master copies of the trainable parameters; unsharded, ``parameters_as`` swaps in
  differentiable casts of them for the duration of a forward, so gradients reach the fp32 masters;
- sharded with FSDP2, the mixed-precision policy's ``param_dtype`` does the same cast when it
  all-gathers (and ``cast_forward_inputs=False`` keeps float inputs such as timesteps as they are).

The three give the same bits: a cast fp32 -> bf16 rounds to nearest-even whether ``copy_`` (loading a
checkpoint into a bf16 rollout model), ``.to`` (here) or FSDP's all-gather does it. Autocast would not:
it runs some ops (norms, softmax) in fp32 and keeps fp32 weights in others, so an autocast trainer and a
natively-bf16 rollout compute different functions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn


_ACTIVE = "_unirl_parameters_as_active"


@contextmanager
def parameters_as(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within this context every floating parameter of ``module`` reads as a cast to ``dtype``.

    The casts are differentiable (gradients flow to the original parameters) and made once per
    parameter object, so tied weights stay tied. Parameters already in ``dtype`` are untouched;
    nothing is swapped when all are. Re-entrant: an inner context over the same module sees the casts
    of the outer one and swaps nothing.
    """
    if getattr(module, _ACTIVE, False):
        # nested inside a context over the same module (e.g. the backend's around every velocity call):
        # the casts are in place; skip walking a model of thousands of sub-modules again
        yield
        return
    casts: dict[int, torch.Tensor] = {}
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    object.__setattr__(module, _ACTIVE, True)
    try:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is None or not isinstance(p, nn.Parameter) or not p.is_floating_point() or p.dtype == dtype:
                    continue
                cast = casts.get(id(p))
                if cast is None:
                    cast = casts[id(p)] = p.to(dtype)
                # _parameters holds what attribute access returns; a plain tensor there is what
                # torch.func.functional_call installs too, and no hook or optimizer sees it.
                sub._parameters[name] = cast
                swapped.append((sub, name, p))
        yield
    finally:
        for sub, name, p in reversed(swapped):
            sub._parameters[name] = p
        object.__setattr__(module, _ACTIVE, False)


def upcast_trainable(module: nn.Module) -> int:
    """Make the trainable parameters fp32 master weights (in place); returns how many were cast.

    Low-precision master weights lose small AdamW updates (bf16 keeps 8 mantissa bits); the forward
    still sees them in the compute dtype through ``parameters_as`` or FSDP's mixed precision.
    """
    n = 0
    for p in module.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
            n += 1
    return n


def rounded(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` when it is a floating tensor of another dtype (``dtype`` None: as it is): the rounding a
    copy into a ``dtype`` parameter applies."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def module_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of ``module``'s frozen parameters (its model dtype), else of its first floating one."""
    first = None
    for p in module.parameters():
        if not p.is_floating_point():
            continue
        if not p.requires_grad:
            return p.dtype
        first = first or p.dtype
    return first or torch.float32


def compute_context(module: nn.Module, dtype: torch.dtype) -> AbstractContextManager[None]:
    """What a bundle's ``compute()`` returns: nothing to do for an FSDP2-sharded module (its mixed-precision
    policy casts on all-gather) or when every parameter is already in ``dtype``; else ``parameters_as``."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return nullcontext()
    return parameters_as(module, dtype)
