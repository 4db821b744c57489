"""LoRA over peft, shared by the diffusion and LM bundles.

``apply_lora`` wraps a module in place with peft's tuner layers and freezes everything but the
adapter; ``lora_state_dict`` / ``load_lora_state_dict`` move only the adapter weights, with the
adapter name stripped from the keys so a checkpoint does not depend on peft's naming.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import fsspec
import safetensors.torch
import torch
from torch import Tensor, nn

from unirl_core.errors import CheckpointError, ConfigError, InvariantError, field_error

logger = logging.getLogger(__name__)

ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""How peft names the keys of a saved adapter: ``base_model.model.<module path>.lora_A.weight``."""
_ADAPTER_TAG = f".{ADAPTER_NAME}."


def apply_lora(module: nn.Module, *, rank: int, alpha: float, target_modules: Sequence[str],
               dropout: float = 0.0, seed: int = 0) -> nn.Module:
    """Inject LoRA layers into ``module`` (in place) and freeze all non-LoRA parameters.

    ``target_modules`` are peft-style names (suffixes of ``named_modules`` paths, e.g. ``to_q``).
    Returns the same module object, now carrying peft tuner layers; the adapter starts as a no-op
    (lora_B = 0), so outputs are unchanged until the first update. ``lora_A`` is drawn from a generator
    seeded with ``seed`` (peft draws it from the process's global generator, so two builds in one process
    started from different adapters); the global generators are left as they were.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if not (isinstance(rank, int) and rank >= 1):
        raise field_error(ConfigError, "lora.rank", rank, "an integer >= 1", "use e.g. 8 or 32")
    if not (alpha > 0):
        raise field_error(ConfigError, "lora.alpha", alpha, "a value > 0", "use e.g. alpha = rank")
    if not (0.0 <= dropout < 1.0):
        raise field_error(ConfigError, "lora.dropout", dropout, "a value in [0, 1)", "use 0.0 for exact replay")
    targets = list(target_modules)
    if not targets:
        raise field_error(ConfigError, "lora.target_modules", target_modules, "at least one module name",
                          "name the attention projections, e.g. ['to_q', 'to_k', 'to_v', 'to_out.0']")
    present = {name.rsplit(".", 1)[-1] for name, _ in module.named_modules()}
    full = {name for name, _ in module.named_modules()}
    missing = [t for t in targets if t not in present and not any(n.endswith("." + t) or n == t for n in full)]
    if len(missing) == len(targets):
        raise field_error(ConfigError, "lora.target_modules", targets,
                          f"names of submodules of {type(module).__name__}",
                          "list module names that exist, e.g. from model.named_modules()")
    if missing:
        logger.warning("LoRA targets %s not found in %s; they are skipped", missing, type(module).__name__)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                     init_lora_weights=True)
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        inject_adapter_in_model(cfg, module, adapter_name=ADAPTER_NAME)
    module.__dict__.pop(_LAYERS, None)  # lora_layers() must find the new layers
    for name, p in module.named_parameters():
        p.requires_grad_("lora_" in name)
    return module


def has_lora(module: nn.Module) -> bool:
    """True when ``module`` carries peft LoRA layers."""
    return any("lora_A" in name for name, _ in module.named_parameters())


def _canonical(key: str) -> str:
    return key.replace(_ADAPTER_TAG, ".")


def lora_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """The adapter weights only, keys without the peft adapter name (``...to_q.lora_A.weight``)."""
    out = {_canonical(k): v.detach().clone() for k, v in module.state_dict().items() if "lora_" in k}
    if not out:
        raise field_error(InvariantError, "module", type(module).__name__, "a module with LoRA layers",
                          "call apply_lora(...) before saving an adapter")
    return out


def load_lora_state_dict(module: nn.Module, sd: dict[str, Tensor]) -> None:
    """Load adapter weights saved by ``lora_state_dict``; every adapter key must match exactly."""
    own = {_canonical(k): k for k in module.state_dict() if "lora_" in k}
    if not own:
        raise field_error(InvariantError, "module", type(module).__name__, "a module with LoRA layers",
                          "call apply_lora(...) with the same targets before loading an adapter")
    missing = sorted(set(own) - set(sd))
    extra = sorted(set(sd) - set(own))
    if missing or extra:
        raise field_error(InvariantError, "lora_state_dict keys", {"missing": missing[:5], "unexpected": extra[:5]},
                          "the adapter keys of this module", "apply_lora with the rank/targets the adapter was saved with")
    params = dict(module.state_dict(keep_vars=True))
    with torch.no_grad():
        for key, full_key in own.items():
            dst, src = params[full_key], sd[key]
            if tuple(dst.shape) != tuple(src.shape):
                raise field_error(InvariantError, f"lora_state_dict[{key!r}].shape", tuple(src.shape),
                                  f"{tuple(dst.shape)}", "use the LoRA rank the adapter was saved with")
            dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


_LAYERS = "_unirl_lora_layers"


def lora_layers(module: nn.Module) -> list[nn.Module]:
    """The peft LoRA layers of ``module``, found once and remembered on it (a reference forward per
    denoising step would otherwise walk every sub-module of a large model each time)."""
    from peft.tuners.lora import LoraLayer

    cached = module.__dict__.get(_LAYERS)
    if cached is None:
        cached = [m for m in module.modules() if isinstance(m, LoraLayer)]
        object.__setattr__(module, _LAYERS, cached)
    return cached


@contextmanager
def lora_disabled(module: nn.Module) -> Iterator[None]:
    """Within this context the peft LoRA layers of ``module`` are bypassed (the base model runs)."""
    layers = lora_layers(module)
    previous = [m.disable_adapters for m in layers]
    # Flip peft's flag directly: enable_adapters() also rewrites requires_grad, which would
    # silently unfreeze or freeze adapter weights the optimizer owns.
    try:
        for m in layers:
            m._disable_adapters = True
        yield
    finally:
        for m, was_disabled in zip(layers, previous):
            m._disable_adapters = was_disabled


def read_peft_adapter(uri: str, *, field: str, rank: int, alpha: float, target_modules: Sequence[str],
                      storage_options: dict | None = None) -> dict[str, Tensor]:
    """The adapter weights of a peft folder at ``uri`` (keys as ``lora_state_dict`` has them), after checking that
    its ``adapter_config.json`` has this model's LoRA shape; errors name ``field``."""
    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    try:
        cfg = json.loads(fs.cat_file(posixpath.join(path, ADAPTER_CONFIG)))
        blob = fs.cat_file(posixpath.join(path, ADAPTER_WEIGHTS))
    except FileNotFoundError as e:
        raise field_error(ConfigError, field, uri, f"a peft adapter folder ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})",
                          f"write one with python -m unirl_core.runs.export ... --format peft ({e})") from None
    want = {"r": rank, "lora_alpha": float(alpha), "target_modules": sorted(target_modules)}
    targets = cfg.get("target_modules")
    got = {"r": cfg.get("r"), "lora_alpha": float(cfg.get("lora_alpha") or 0),
           "target_modules": sorted([targets] if isinstance(targets, str) else targets or [])}
    if got != want:
        raise field_error(ConfigError, field, uri, f"an adapter of this model's LoRA shape {want}",
                          f"its {ADAPTER_CONFIG} says {got}: set the run's LoRA rank / alpha / target modules to the "
                          "adapter's, or point the field at an adapter of this shape")
    weights = safetensors.torch.load(blob)
    foreign = [k for k in weights if not k.startswith(PEFT_PREFIX)]
    if foreign:
        raise field_error(CheckpointError, f"{field}: {ADAPTER_WEIGHTS}", foreign[:5],
                          f"keys starting with {PEFT_PREFIX!r}", "write the adapter with peft's save_pretrained")
    return {k[len(PEFT_PREFIX):].replace(".default.", "."): v for k, v in weights.items()}


def load_adapter(module: nn.Module, uri: str, *, field: str, rank: int, alpha: float,
                 target_modules: Sequence[str]) -> None:
    """Start ``module``'s LoRA (applied with this shape) from the peft adapter folder at ``uri``."""
    weights = read_peft_adapter(uri, field=field, rank=rank, alpha=alpha, target_modules=target_modules)
    try:
        load_lora_state_dict(module, weights)
    except InvariantError as e:
        raise field_error(ConfigError, field, uri, "an adapter of this model's modules",
                          f"it was saved from another model or LoRA layout: {e}") from None
    logger.info("LoRA of %s starts from the adapter at %s (%d tensors)", type(module).__name__, uri, len(weights))
