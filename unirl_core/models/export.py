"""A bundle written as a folder other libraries load with ``from_pretrained``, and a LoRA adapter read back.

Three formats (``EXPORT_FORMATS``), each a writer of a bundle into a local folder:

- ``peft``: the LoRA adapter alone (``adapter_config.json`` + ``adapter_model.safetensors``, keys
  ``base_model.model.<module path>.lora_A.weight``), for ``peft.PeftModel.from_pretrained(base, folder)`` over the
  base model the run started from (the LM, or the diffusion pipeline's transformer). LoRA runs only.
- ``diffusers``: the whole pipeline (``DiffusionPipeline.from_pretrained``), LoRA merged into a copy of the
  transformer.
- ``transformers``: model + tokenizer (``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``), LoRA merged.

``lora.load_adapter`` is the way back: a run whose ``model.adapter`` names such a folder starts its LoRA from it.
Where a version comes from (a run's checkpoint store) is ``unirl_core.runs.export``'s concern.
"""

from __future__ import annotations

import json
import posixpath
import tempfile

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import fsspec
import safetensors.torch

from unirl_core.errors import ConfigError, field_error
from unirl_core.models.diffusion import LORA_TARGETS, DiffusionBundle
from unirl_core.models.lm import merged_copy
from unirl_core.models.lora import ADAPTER_WEIGHTS, PEFT_PREFIX, has_lora, lora_state_dict

ExportFormat = Literal["peft", "diffusers", "transformers"]


def lora_shape(bundle) -> tuple[int, float, tuple[str, ...]]:
    """(rank, alpha, target module names) of a LoRA bundle, as its config says."""
    c = bundle.config
    if isinstance(bundle, DiffusionBundle):
        return c.lora.rank, float(c.lora.alpha), tuple(c.lora.target_modules or LORA_TARGETS[bundle.family])
    return c.lora_rank, float(c.lora_alpha), tuple(c.lora_target_modules)


def _family(bundle) -> str:
    return "diffusion" if isinstance(bundle, DiffusionBundle) else "lm"


def save_peft(bundle, out: Path, *, base_model: str) -> None:
    """The bundle's LoRA adapter in peft's folder layout (``base_model``: what ``base_model_name_or_path`` says)."""
    from peft import LoraConfig

    if not has_lora(bundle.module):
        raise field_error(ConfigError, "export format", "peft", "a LoRA run (finetune: lora)",
                          "export a full fine-tune as --format diffusers or --format transformers")
    rank, alpha, targets = lora_shape(bundle)
    out.mkdir(parents=True, exist_ok=True)
    weights = {PEFT_PREFIX + k: v.contiguous() for k, v in lora_state_dict(bundle.module).items()}
    safetensors.torch.save_file(weights, str(out / ADAPTER_WEIGHTS))
    task = "CAUSAL_LM" if _family(bundle) == "lm" else None
    LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
               task_type=task, base_model_name_or_path=base_model).save_pretrained(str(out))


def save_diffusers(bundle, out: Path, *, base_model: str = "") -> None:
    """The diffusion pipeline (``save_pretrained``), LoRA merged into a copy of the transformer."""
    if _family(bundle) != "diffusion":
        raise field_error(ConfigError, "export format", "diffusers", "a diffusion run",
                          "export an LM as --format transformers (or peft for a LoRA run)")
    pipe = bundle.pipeline
    original = pipe.transformer
    if has_lora(original):
        pipe.transformer = merged_copy(original)
    try:
        pipe.save_pretrained(out)
    finally:
        pipe.transformer = original


def save_transformers(bundle, out: Path, *, base_model: str = "") -> None:
    """The causal LM + tokenizer (``LMBundle.save_pretrained``: LoRA merged)."""
    if _family(bundle) != "lm":
        raise field_error(ConfigError, "export format", "transformers", "an LM run",
                          "export a diffusion run as --format diffusers (or peft for a LoRA run)")
    bundle.save_pretrained(out)


EXPORT_FORMATS: dict[str, Callable[..., None]] = {"peft": save_peft, "diffusers": save_diffusers,
                                                  "transformers": save_transformers}
"""Format name -> writer ``(bundle, out_dir, *, base_model)``."""


def default_format(bundle) -> ExportFormat:
    """``peft`` for a LoRA bundle, else the family's full format."""
    if has_lora(bundle.module):
        return "peft"
    return "diffusers" if _family(bundle) == "diffusion" else "transformers"


def save_export(bundle, fmt: str, out: Path, *, base_model: str = "") -> None:
    """Write ``bundle`` into the local folder ``out`` in format ``fmt``."""
    if fmt not in EXPORT_FORMATS:
        raise field_error(ConfigError, "export format", fmt, f"one of {sorted(EXPORT_FORMATS)}",
                          "peft (a LoRA adapter), diffusers (a pipeline) or transformers (an LM)")
    EXPORT_FORMATS[fmt](bundle, out, base_model=base_model)


EXPORT_MARKER = "export.json"
"""Written last into an export folder: which version and format it holds. A folder without it is incomplete."""


def write_export(bundle, fmt: str, uri: str, marker: dict, *, base_model: str = "",
                 storage_options: dict | None = None) -> str:
    """Write ``bundle`` in format ``fmt`` to ``uri`` (local or remote), ``export.json`` (``marker`` + the format)
    last; a previous marker there is removed first, so a folder being rewritten never reads as complete."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if fs.exists(posixpath.join(path, EXPORT_MARKER)):
        fs.rm_file(posixpath.join(path, EXPORT_MARKER))
    with tempfile.TemporaryDirectory(prefix="unirl-export-") as tmp:
        save_export(bundle, fmt, Path(tmp), base_model=base_model)
        fs.makedirs(path, exist_ok=True)
        fs.put(f"{tmp}/", path, recursive=True)
    with fs.open(posixpath.join(path, EXPORT_MARKER), "w") as f:
        json.dump({**marker, "format": fmt}, f, indent=1, sort_keys=True)
    return uri
