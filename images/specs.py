"""One ImageSpec per role. All three start from the same CUDA runtime base so layers are shared.

Why three: rollout pods need the model stack (diffusers/transformers) but not the OCR/math scorers;
reward pods need the scorers; train pods need the model stack plus the PyTorch-Elastic plugin.
Local runs ignore ImageSpecs entirely (flytekit runs everything in this Python process).

Which image a task gets is decided when it is serialized (``pyflyte package / register / run --remote``):

1. ``--image <role>=IMG`` (role: ``rollout``, ``reward``, ``train``; or an ``images:`` entry of that name in
   the Flyte config file): that role's tasks run IMG;
2. else ``--image IMG`` (pyflyte's default image): every task runs IMG;
3. else (pyflyte fell back to flytekit's own default image): the role's ImageSpec below, built by flytekit
   when missing. Its registry comes from ``UNIRL_IMAGE_REGISTRY`` (e.g. ``ghcr.io/my-org``).

An image given with ``--image`` must hold every dependency of the roles it serves (one image with the
``[project]`` dependencies of pyproject.toml serves all three).
"""

from __future__ import annotations

import os

from flytekit import ImageSpec
from flytekit.configuration import ImageConfig
from flytekit.configuration.default_images import DefaultImages
from flytekit.core.context_manager import FlyteContextManager
from flytekit.image_spec.image_spec import _F_IMG_ID

REGISTRY_ENV = "UNIRL_IMAGE_REGISTRY"
ROLES = ("rollout", "reward", "train")
CUDA_BASE = "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
PYTHON = "3.11"

# torch comes from the CUDA wheel index: the default PyPI torch is a CUDA build too, but pinning the index
# keeps the CUDA minor version in step with the base image.
TORCH_INDEX = "https://download.pytorch.org/whl/cu128"
_CORE = [
    "torch==2.13.0",
    "numpy>=1.26",
    "pyarrow>=16",
    "safetensors>=0.4",
    "fsspec>=2024.1",
    "s3fs>=2024.1",
    "pillow>=10",
    "pyyaml>=6",
    "tensorboard==2.21.0",
    "matplotlib==3.11.2",
    "xxhash==4.1.0",
    "zstandard==0.25.0",
    "httpx>=0.27",
    "flytekit==1.16.31",
]
_MODELS = ["diffusers>=0.35", "transformers>=4.56,<5.20", "peft>=0.17", "accelerate>=1.0"]
# pool.execution: pool: every phase task is a Ray client of the run's pool (ray:// address), in every role; the
# client's Ray (and Python) must be the pool cluster's (pool.kuberay.image)
_POOL = ["ray[client]==2.60.0"]
# report.wandb / report.mlflow: the report task (train image) opens the run's sinks
_TRACKING = ["wandb==0.31.0", "mlflow-skinny==3.18.0"]
_REWARD = ["rapidocr>=3.0", "onnxruntime-gpu>=1.17", "math-verify[antlr4_13_2]>=0.7", "fastapi>=0.110",
           "uvicorn>=0.29"]


def given_image(cfg: ImageConfig | None, role: str) -> str | None:
    """The image named for ``role`` at serialization (``--image role=IMG``, else an explicit ``--image IMG``),
    or None when the role's ImageSpec decides. flytekit fills the default image with its own
    ``cr.flyte.org/flyteorg/flytekit:py3.x-<version>`` when no ``--image`` is given: that one does not count."""
    if cfg is None:
        return None
    for img in cfg.images or []:
        if img.name == role:
            return img.full
    default = cfg.default_image
    if default is not None and default.full != DefaultImages.default_image():
        return default.full
    return None


class RoleImage(ImageSpec):
    """An ImageSpec that gives way to an image passed at serialization (see the module docstring).

    No new dataclass field: the spec's ``id`` (the hash baked into a built image as ``_F_IMG_ID``) stays
    that of a plain ImageSpec with the same settings."""

    @property
    def role(self) -> str:
        return self.name.removeprefix("unirl-")

    def given(self) -> str | None:
        settings = FlyteContextManager.current_context().serialization_settings
        return given_image(settings.image_config if settings else None, self.role)

    def image_name(self) -> str:
        return self.given() or super().image_name()

    def exist(self) -> bool | None:
        # flytekit asks before building: an image given with --image is never built from this spec
        return True if self.given() else super().exist()

    def is_container(self) -> bool:
        """False only in a pod of *another* of our role images (the guarded imports are then skipped); True
        locally, at registration and in any image given with ``--image`` (no ``_F_IMG_ID``, or a foreign one)."""
        current = os.environ.get(_F_IMG_ID)
        if current is None or current not in {s.id for s in (rollout_image, reward_image, train_image)}:
            return True
        return super().is_container()


def _spec(name: str, packages: list[str], apt: list[str] | None = None) -> RoleImage:
    registry = os.environ.get(REGISTRY_ENV) or None
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if registry:
        # baked into the image so a pod recomputes the same spec (and id) as the registering machine
        env[REGISTRY_ENV] = registry
    return RoleImage(
        name=f"unirl-{name}",
        base_image=CUDA_BASE,
        python_version=PYTHON,
        packages=packages,
        apt_packages=apt,
        pip_extra_index_url=[TORCH_INDEX],
        registry=registry,
        # the project source (unirl_core, tasks, workflows, images) travels with fast register / the package
        env=env,
    )


rollout_image = _spec("rollout", _CORE + _MODELS + _POOL)
"""Rollout shards: trainside diffusion / AR engines (model stack, no scorers)."""

reward_image = _spec("reward", _CORE + _MODELS + _POOL + _REWARD, apt=["libgl1", "libglib2.0-0"])
"""Reward scoring: OCR (ONNX), math verification, CLIP-family scorers (they need the model stack too)."""

train_image = _spec("train", _CORE + _MODELS + _POOL + _TRACKING + ["flytekitplugins-kfpytorch==1.16.31", "kubernetes<37"])
"""Training (FSDP2 under PyTorch-Elastic), advantage, publish, report (W&B, MLflow) and the small bookkeeping
tasks."""
