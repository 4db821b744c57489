"""Turn a publish (a model/adapter directory or a ``CheckpointRef``) into a folder a server loads.

Inference servers load weights from a directory by file layout, not from our checkpoint store:

- full weights: ``*.safetensors`` with the transformers parameter names (``model.layers.0...``);
- a LoRA adapter: peft's layout, ``adapter_config.json`` + ``adapter_model.safetensors`` with keys
  ``base_model.model.<module path>.lora_A.weight``.

A checkpoint version keeps one ``weights`` safetensors file (full state dict, or the adapter only
with peft's adapter name stripped, see ``unirl_core.models.lora``). ``stage_weights`` checks the
manifest checksum (via ``load_weights``), decides which of the two it is, and writes the matching
layout into a staging folder that the server can see.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Literal

import safetensors.torch
from torch import Tensor

from unirl_core.errors import CheckpointError, ConfigError, field_error

logger = logging.getLogger(__name__)

WeightKind = Literal["full", "lora"]
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


def is_checkpoint_ref(obj: object) -> bool:
    """Duck-typed ``CheckpointRef`` test (uri + policy_version), so this module imports no store."""
    return hasattr(obj, "uri") and hasattr(obj, "policy_version") and not isinstance(obj, (str, os.PathLike))


def directory_kind(path: Path) -> WeightKind:
    """``lora`` for a peft adapter folder, ``full`` for a folder of safetensors weights."""
    if not path.is_dir():
        raise field_error(CheckpointError, "weights", str(path), "an existing directory",
                          "publish a save_pretrained folder or a CheckpointRef")
    if (path / ADAPTER_CONFIG).exists():
        return "lora"
    if not any(path.glob("*.safetensors")):
        raise field_error(CheckpointError, "weights", str(path), "a folder with *.safetensors or an adapter",
                          "save weights with save_pretrained(..., safe_serialization=True)")
    return "full"


def _lora_shape(weights: dict[str, Tensor]) -> tuple[int, list[str]]:
    other = [k for k in weights if ".lora_" not in k]
    if other:
        raise field_error(CheckpointError, "lora weights", other[:5], "adapter tensors only (*.lora_A/B.weight)",
                          "save lora_state_dict(module) for LoRA runs, or merge the adapter and publish full weights")
    ranks = {int(v.shape[0]) for k, v in weights.items() if k.endswith("lora_A.weight")}
    if len(ranks) != 1:
        raise field_error(CheckpointError, "lora ranks", sorted(ranks), "exactly one rank",
                          "publish an adapter trained with one rank for every module")
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in weights if ".lora_" in k})
    return ranks.pop(), targets


def write_peft_adapter(weights: dict[str, Tensor], out: Path, *, alpha: float, base_model: str) -> Path:
    """Write adapter-only weights (keys ``<module>.lora_A.weight``) in peft's folder layout."""
    rank, targets = _lora_shape(weights)
    out.mkdir(parents=True, exist_ok=True)
    peft_sd = {_PEFT_PREFIX + k: v.contiguous() for k, v in weights.items()}
    safetensors.torch.save_file(peft_sd, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
           "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
           "base_model_name_or_path": base_model, "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (out / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=1), encoding="utf-8")
    return out


def stage_weights(source: object, *, want: WeightKind, staging: Path, policy_version: int,
                  lora_alpha: float | None = None, base_model: str = "") -> Path:
    """A local folder of kind ``want`` holding ``source`` (a folder is used as is, a ref is unpacked)."""
    if is_checkpoint_ref(source):
        if int(source.policy_version) != policy_version:
            raise field_error(ConfigError, "policy_version", policy_version,
                              f"the ref's policy_version {source.policy_version}",
                              "publish a ref with the version it was saved under")
        from unirl_core.checkpoint import load_weights

        return stage_state_dict(load_weights(source), want=want, staging=staging, policy_version=policy_version,
                                lora_alpha=lora_alpha, base_model=base_model, where=source.uri)
    path = Path(os.fspath(source)).resolve()
    _check_kind(directory_kind(path), want, str(path))
    return path


def stage_state_dict(weights: dict[str, Tensor], *, want: WeightKind, staging: Path, policy_version: int,
                     lora_alpha: float | None = None, base_model: str = "", where: str = "weights") -> Path:
    """Write a version's state dict (a checkpoint's ``weights`` file, or the trainer's ``model_state_dict`` sent
    in-pool) as ``staging/policy-v<N>`` in the layout of kind ``want``; ``where`` names its source in errors."""
    kind: WeightKind = "lora" if any(".lora_" in k for k in weights) else "full"
    _check_kind(kind, want, where)
    out = staging / f"policy-v{policy_version:08d}"
    if kind == "lora":
        if lora_alpha is None:
            raise field_error(ConfigError, "engine.lora_alpha", None, "the trainer's LoRA alpha",
                              "set lora_alpha on the engine config to publish LoRA checkpoint refs")
        return write_peft_adapter(weights, out, alpha=lora_alpha, base_model=base_model)
    out.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(_unshared(weights), str(out / "model.safetensors"))
    _copy_configs(base_model, out)
    logger.info("staged %d tensors of %s in %s", len(weights), where, out)
    return out


def _unshared(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous tensors, a tensor sharing memory with an earlier one cloned: safetensors refuses shared
    storage, and a trainer's state dict names a tied weight (``lm_head`` = embeddings) under both names."""
    seen: set[int] = set()
    out = {}
    for name, t in weights.items():
        t = t.contiguous()
        if t.data_ptr() in seen:
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return out


def _copy_configs(base_model: str, out: Path) -> None:
    # Some loaders (SGLang's update_weights_from_disk) open the folder like a model folder.
    base = Path(base_model) if base_model else None
    if base is None or not base.is_dir():
        return
    for name in ("config.json", "generation_config.json"):
        if (base / name).exists():
            shutil.copyfile(base / name, out / name)


def _check_kind(got: WeightKind, want: WeightKind, where: str) -> None:
    if got != want:
        fix = ("configure weight_sync='lora' to serve adapters" if got == "lora"
               else "configure weight_sync='reload' to serve full weights")
        raise field_error(ConfigError, f"weights {where}", got, f"{want} weights for this engine", fix)
