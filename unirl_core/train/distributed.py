"""Process-group setup and FSDP2 sharding for the train backend.

torchrun / PyTorch Elastic (and Flyte's kfpytorch plugin) export RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; without them the job is a single process and needs no process group.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from unirl_core.errors import ConfigError, field_error

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise field_error(ConfigError, name, raw, "an integer", "launch with torchrun, which sets it") from None


def init_distributed(device: str | torch.device | None = None) -> DistInfo:
    """Join the process group described by the torchrun env vars (gloo on CPU, nccl on CUDA).

    Idempotent: an already initialised group is reused. With WORLD_SIZE unset or 1 no group is created.
    ``device`` None picks ``cuda:<LOCAL_RANK>`` when CUDA is available, else CPU.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if device is None:
        dev = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device(f"cuda:{local_rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=dev)
    if world > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=dev if dev.type == "cuda" else None)
        log.info("joined process group: backend=%s rank=%d/%d device=%s", backend, rank, world, dev)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def ensure_process_group(device: torch.device) -> None:
    """Create a single-rank group (in-memory store, no port) when none exists, so FSDP2 can build its
    device mesh at world size 1; a group made by torchrun / init_distributed is left as it is."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    log.info("created a single-rank %s process group for shard='always'", backend)


def current_world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def apply_fsdp(module: nn.Module, wrap_classes: tuple[str, ...], mp_dtype: torch.dtype | None,
               device: torch.device | None = None) -> nn.Module:
    """Shard ``module`` in place with FSDP2: each sub-module whose class name is listed, then the root.

    Inner units first so the root only owns the leftovers (embeddings, heads). Gradients are reduced in
    fp32 whatever the compute dtype; when a compute dtype is given, parameters are all-gathered in it
    (which also lets bf16 frozen weights and fp32 LoRA masters share one unit) and the module runs natively
    in it: the policy's compute context (``unirl_core.models.precision``). Forward inputs are NOT cast
    (``cast_forward_inputs=False``): a float timestep must reach the model as the rollout passed it.

    ``device``: where the module lives (default: its first parameter's device). The device mesh is built on
    that device type explicitly: FSDP2's default mesh follows CUDA's availability, so a CPU (gloo) job on a
    host with fewer GPUs than ranks would otherwise try ``cuda:<local rank>``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device is None:
        first = next(module.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    wanted = set(wrap_classes)
    found = 0
    for sub in module.modules():
        if sub is not module and type(sub).__name__ in wanted:
            fully_shard(sub, mesh=mesh, mp_policy=mp)
            found += 1
    if wanted and not found:
        raise field_error(ConfigError, "train.fsdp_wrap_classes", sorted(wanted),
                          f"class names present in {type(module).__name__}",
                          "list the transformer-block class, e.g. 'Qwen3DecoderLayer'")
    fully_shard(module, mesh=mesh, mp_policy=mp)
    return module


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor behind a DTensor shard (collective: every rank must call it), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def like_layout(full: Tensor, like: Tensor) -> Tensor:
    """``full`` laid out as ``like``: the local shard when ``like`` is a DTensor, else a same-device copy."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements)
    return full.to(like.device, like.dtype)


def all_reduce_metrics(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Reduce float metrics over ranks (identity without a process group); keys must match on all ranks.

    ``*_max`` keys take the maximum over ranks, ``*_min`` the minimum, every other key the mean.
    """
    _, world = current_world()
    if world == 1 or not values:
        return values
    out: dict[str, float] = {}
    for op, keys in ((dist.ReduceOp.MAX, [k for k in sorted(values) if k.endswith("_max")]),
                     (dist.ReduceOp.MIN, [k for k in sorted(values) if k.endswith("_min")]),
                     (dist.ReduceOp.SUM, [k for k in sorted(values) if not k.endswith(("_max", "_min"))])):
        if not keys:
            continue
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        scale = world if op == dist.ReduceOp.SUM else 1
        out.update({k: float(v) / scale for k, v in zip(keys, t.tolist())})
    return out
