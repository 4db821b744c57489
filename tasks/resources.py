"""Each role's pod resources for one recipe: the recipe's ``cluster.<role>`` fields over the defaults of its shape.

The task decorators declare the GPU shape (what a registered task shows before any recipe is known); the @dynamic
chunk applies a recipe's resources to every node it wires (``with_overrides``), so one registered workflow runs a
tiny recipe on CPU pods and ``sd35m-pickscore`` on the GPUs its ``cluster:`` section asks for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from flytekit import Resources

from tasks.common import ACCELERATORS, DEFAULT_ACCELERATOR
from tasks.run_types import ClusterConfig, PodResources
from unirl_core.config import RunConfig
from unirl_core.errors import ConfigError, field_error
from unirl_core.models.diffusion import is_preset

Role = Literal["rollout", "reward", "train"]

CPU_SHAPE = PodResources(gpu=0, cpu="2", mem="8Gi", mem_limit="16Gi")
"""A model built in code (the tiny presets): no GPU, no accelerator."""
GPU_SHAPE = PodResources(gpu=1, cpu="8", mem="64Gi", mem_limit="96Gi")
"""Any downloaded model: one GPU of the cluster's kind (``tasks.common.GPU_TASK``)."""


def shape(cfg: RunConfig) -> PodResources:
    """The default resources of ``cfg``'s model: CPU pods for a tiny preset, GPU pods otherwise."""
    tiny = is_preset(cfg.diffusion.model.source) if cfg.family == "diffusion" else cfg.lm.model.model == "tiny"
    return CPU_SHAPE if tiny else GPU_SHAPE


def resources(cfg: RunConfig, cluster: ClusterConfig, role: Role) -> PodResources:
    """``cluster.<role>`` with every unset field taken from ``shape(cfg)``; a multi-GPU train topology's pods get
    ``cluster.train_nproc_per_node`` GPUs."""
    given = getattr(cluster, role)
    out = dataclasses.replace(shape(cfg), **{f.name: getattr(given, f.name) for f in dataclasses.fields(given)
                                             if getattr(given, f.name) is not None})
    # pool mode trains through one client task whatever the topology (the pool's trainer holds the GPUs)
    if role == "train" and cfg.pool.execution != "pool" and \
            (cluster.train_nnodes, cluster.train_nproc_per_node) != (1, 1):
        out = dataclasses.replace(out, gpu=cluster.train_nproc_per_node)
    if _bytes(out.mem_limit) < _bytes(out.mem):
        raise field_error(ConfigError, f"cluster.{role}.mem_limit", out.mem_limit,
                          f"at least the memory request ({out.mem})", f"raise cluster.{role}.mem_limit or lower "
                          f"cluster.{role}.mem (Kubernetes refuses a limit below the request)")
    return out


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
          "Ti": 2**40, "m": 1e-3}


def _bytes(quantity: str) -> float:
    number = quantity.rstrip("kMGTmi")
    return float(number) * _UNITS[quantity[len(number):]]


def overrides(cfg: RunConfig, cluster: ClusterConfig, role: Role) -> dict[str, Any]:
    """``with_overrides`` arguments of a ``role`` node: requests, limits and (GPU pods) the accelerator."""
    r = resources(cfg, cluster, role)
    out: dict[str, Any] = {"requests": Resources(cpu=r.cpu, mem=r.mem, gpu=str(r.gpu)),
                           "limits": Resources(mem=r.mem_limit, gpu=str(r.gpu))}
    if r.gpu:
        out["accelerator"] = ACCELERATORS[cluster.accelerator] if cluster.accelerator else DEFAULT_ACCELERATOR
    return out


def check_all(cfg: RunConfig, cluster: ClusterConfig) -> None:
    """Resolve every role's resources once (the setup task): a limit below its request fails before any pod."""
    for role in ("rollout", "reward", "train"):
        resources(cfg, cluster, role)
