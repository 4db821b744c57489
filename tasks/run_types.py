"""Flyte types of the run: RunConfig as canonical JSON, content-keyed CheckpointRef, ClusterConfig.

RunConfig: flytekit's own dataclass support does accept it, but ``checkpoint.storage_options`` is
``dict[str, Any]`` and flytekit ships ``Any`` as a pickle file at a random path: the literal is not portable
across Python versions and its cache key changes on every run. So RunConfig travels as a STRING literal
holding ``to_dict(cfg)`` as sorted-key JSON and is rebuilt (and re-validated) with ``from_dict``; equal
configs give equal literals, so cache keys are stable.

CheckpointRef is a plain frozen dataclass of str/int fields: flytekit's dataclass support handles it. Its
cache key should follow the checkpoint's content, not its URI (a wiped and re-trained run reuses the URI),
so tasks return ``HashedCheckpointRef``, which hashes the sha256 of every file the manifest lists.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from typing import Annotated

from flytekit import FlyteContext, HashMethod
from flytekit.core.type_engine import TypeTransformerFailedError
from flytekit.extend import TypeEngine, TypeTransformer
from flytekit.models.literals import Literal, Primitive, Scalar
from flytekit.models.types import LiteralType, SimpleType

from unirl_core.checkpoint import CheckpointRef
from unirl_core.checkpoint.manifest import MANIFEST, Manifest
from unirl_core.config import RunConfig, from_dict, load_recipe_dict, to_dict
from unirl_core.errors import ConfigError, field_error

RUN_CONFIG_META = {"unirl.type": "RunConfig", "encoding": "json"}


def run_config_json(cfg: RunConfig) -> str:
    """Canonical JSON of a RunConfig (sorted keys, no whitespace): equal configs give equal strings."""
    return json.dumps(to_dict(cfg), sort_keys=True, separators=(",", ":"), allow_nan=False)


@functools.lru_cache(maxsize=16)
def _parse_run_config(raw: str) -> RunConfig:
    # every task of a step decodes the same config: validating it once per process saves ~3 ms a task
    # (sharing one instance is safe: RunConfig and its sections are frozen)
    return from_dict(RunConfig, json.loads(raw), "RunConfig")


class RunConfigTransformer(TypeTransformer[RunConfig]):
    def __init__(self) -> None:
        super().__init__(name="RunConfig", t=RunConfig)

    def get_literal_type(self, t: type[RunConfig]) -> LiteralType:
        return LiteralType(simple=SimpleType.STRING, metadata=RUN_CONFIG_META)

    def to_literal(self, ctx: FlyteContext, python_val: RunConfig, python_type: type[RunConfig],
                   expected: LiteralType) -> Literal:
        if not isinstance(python_val, RunConfig):
            raise TypeTransformerFailedError(f"expected a RunConfig, got {type(python_val).__name__}")
        return Literal(scalar=Scalar(primitive=Primitive(string_value=run_config_json(python_val))))

    def to_python_value(self, ctx: FlyteContext, lv: Literal, expected_python_type: type[RunConfig]) -> RunConfig:
        raw = lv.scalar.primitive.string_value if lv.scalar and lv.scalar.primitive else None
        if raw is None:
            raise TypeTransformerFailedError(f"expected a STRING literal holding RunConfig JSON, got {lv}")
        return _parse_run_config(raw)

    def guess_python_type(self, literal_type: LiteralType) -> type[RunConfig]:
        if literal_type.simple == SimpleType.STRING and literal_type.metadata == RUN_CONFIG_META:
            return RunConfig
        raise ValueError(f"cannot guess a RunConfig from {literal_type}")

    def to_html(self, ctx: FlyteContext, python_val: RunConfig, expected_python_type: type[RunConfig]) -> str:
        return f"<pre>{json.dumps(to_dict(python_val), indent=1, sort_keys=True)}</pre>"


TypeEngine.register(RunConfigTransformer())


# fsspec options of the checkpoint store of the task running in this process: HashMethod only receives the
# value, and an s3:// store needs its endpoint options to read the manifest
_STORAGE_OPTIONS: dict[str, object] = {}


def use_storage_options(cfg: RunConfig) -> None:
    """Tell ``checkpoint_digest`` how to reach this run's store (tasks call it before returning a ref)."""
    _STORAGE_OPTIONS.clear()
    _STORAGE_OPTIONS.update(cfg.checkpoint.storage_options)


def checkpoint_digest(ref: CheckpointRef) -> str:
    """sha256 over the version's step, policy version and the sha256 of every file its manifest lists
    (not the manifest bytes: they hold the write time, which differs when a step is retrained identically)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(ref.uri, **_STORAGE_OPTIONS)
    where = f"{ref.uri}/{MANIFEST}"
    manifest = Manifest.from_json(fs.cat_file(f"{path.rstrip('/')}/{MANIFEST}"), where)
    content = {"step": manifest.step, "policy_version": manifest.policy_version,
               "files": {name: entry["sha256"] for name, entry in manifest.files.items()}}
    return "sha256:" + hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


HashedCheckpointRef = Annotated[CheckpointRef, HashMethod(checkpoint_digest)]

TRAIN_TOPOLOGIES = ((1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8))


_QUANTITY = re.compile(r"^\d+(\.\d+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PodResources:
    """One role's pod resources (``cluster.rollout`` / ``cluster.reward`` / ``cluster.train``); an unset field takes
    the default of the recipe's shape (``tasks/resources.py``: a tiny preset model runs on CPU pods, any other model
    on 1 GPU, 8 CPUs, 64 Gi requested / 96 Gi limit)."""

    gpu: int | None = None
    """GPUs of the pod (0: a CPU pod, no accelerator). The train task of a multi-GPU topology takes
    ``cluster.train_nproc_per_node`` instead."""
    cpu: str | None = None
    """CPU request, a Kubernetes quantity (``8``, ``500m``)."""
    mem: str | None = None
    """Memory request (``64Gi``)."""
    mem_limit: str | None = None
    """Memory limit (``96Gi``); at least the request."""

    def check(self, where: str) -> None:
        if self.gpu is not None and (isinstance(self.gpu, bool) or not isinstance(self.gpu, int) or self.gpu < 0):
            raise field_error(ConfigError, f"{where}.gpu", self.gpu, "an integer >= 0", "e.g. 1 (0: a CPU pod)")
        for name in ("cpu", "mem", "mem_limit"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and _QUANTITY.match(v)):
                raise field_error(ConfigError, f"{where}.{name}", v, "a Kubernetes quantity as a string",
                                  "e.g. '8' or '500m' for cpu, '64Gi' for memory")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the phases run on a cluster (the optional ``cluster:`` section of a recipe): how the train phase
    spreads over GPUs, each role's pod resources and the GPU kind.

    It is orchestration, not training semantics, so it is kept out of RunConfig (and out of the checkpoint's
    config): the same RunConfig trains identically on 1x8 or 2x8 GPUs. ``run_local`` ignores the section."""

    train_nnodes: int = 1
    """Nodes of the train job; above 1 it runs as a PyTorchJob (PyTorch-Elastic plugin)."""
    train_nproc_per_node: int = 1
    """Training processes (GPUs) per node; 1 node x 1 process trains in the task's own process."""
    accelerator: str | None = None
    """GPU kind of the GPU pods: ``h100`` or ``h200``; None: ``UNIRL_ACCELERATOR`` when the workflow is registered
    (default ``h200``)."""
    rollout: PodResources = dataclasses.field(default_factory=PodResources)
    """Rollout pods (each shard's), the held-out eval's and DAPO's dynamic-sampling rounds' (they sample with the
    model too)."""
    reward: PodResources = dataclasses.field(default_factory=PodResources)
    """Reward pods."""
    train: PodResources = dataclasses.field(default_factory=PodResources)
    """Train pods (each node's pod of a multi-node train job)."""

    def __post_init__(self) -> None:
        if self.accelerator is not None and self.accelerator not in ("h100", "h200"):
            raise field_error(ConfigError, "cluster.accelerator", self.accelerator, "'h100' or 'h200'",
                              "name the GPU kind of your cluster's GPU nodes, or leave it unset (UNIRL_ACCELERATOR)")
        for role in ("rollout", "reward", "train"):
            getattr(self, role).check(f"cluster.{role}")
        shape = (self.train_nnodes, self.train_nproc_per_node)
        if shape not in TRAIN_TOPOLOGIES:
            raise field_error(ConfigError, "cluster.train_nnodes x train_nproc_per_node", shape,
                              f"one of {TRAIN_TOPOLOGIES}", "each shape is a registered train task "
                              "(tasks/train.py); add one there for another shape")


def load_run_config(recipe: str, overrides: list[str]) -> tuple[RunConfig, ClusterConfig]:
    """Recipe + overrides -> (RunConfig, ClusterConfig); ``cluster.*`` keys go to the ClusterConfig."""
    data = load_recipe_dict(recipe, list(overrides))
    cluster = from_dict(ClusterConfig, data.pop("cluster", {}) or {}, "recipe.cluster")
    return from_dict(RunConfig, data, "recipe"), cluster
