"""One ImageSpec per role. All three start from the same CUDA runtime base so layers are shared.

Why three: rollout pods need the model stack (diffusers/transformers) but not the OCR/math scorers;
reward pods need the scorers; train pods need the model stack plus the PyTorch-Elastic plugin.
Local runs ignore ImageSpecs entirely (flytekit runs everything in this Python process).

The registry comes from ``UNIRL_IMAGE_REGISTRY`` (e.g. ``ghcr.io/my-org``) so a cluster user pushes to
their own registry without editing code; without it the images carry no registry prefix.
"""

from __future__ import annotations

import os

from flytekit import ImageSpec

REGISTRY_ENV = "UNIRL_IMAGE_REGISTRY"
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
    "flytekit==1.16.31",
]
_MODELS = ["diffusers>=0.35", "transformers>=4.56,<5.20", "peft>=0.17", "accelerate>=1.0"]
_REWARD = ["rapidocr>=3.0", "onnxruntime-gpu>=1.17", "math-verify[antlr4_13_2]>=0.7", "fastapi>=0.110",
           "uvicorn>=0.29", "httpx>=0.27"]


def _spec(name: str, packages: list[str], apt: list[str] | None = None) -> ImageSpec:
    return ImageSpec(
        name=f"unirl-{name}",
        base_image=CUDA_BASE,
        python_version=PYTHON,
        packages=packages,
        apt_packages=apt,
        pip_extra_index_url=[TORCH_INDEX],
        registry=os.environ.get(REGISTRY_ENV) or None,
        # the project source (unirl_core, tasks, workflows, images) travels with fast register / the package
        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )


rollout_image = _spec("rollout", _CORE + _MODELS)
"""Rollout shards: trainside diffusion / AR engines (model stack, no scorers)."""

reward_image = _spec("reward", _CORE + _MODELS + _REWARD, apt=["libgl1", "libglib2.0-0"])
"""Reward scoring: OCR (ONNX), math verification, CLIP-family scorers (they need the model stack too)."""

train_image = _spec("train", _CORE + _MODELS + ["flytekitplugins-kfpytorch==1.16.31", "kubernetes<37"])
"""Training (FSDP2 under PyTorch-Elastic), advantage, publish and the small bookkeeping tasks."""
