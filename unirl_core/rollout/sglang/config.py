"""Configuration of the SGLang rollout engine (an SGLang server in its own process).

SGLang ships no CPU build, so this engine was written against SGLang's documented HTTP API and
checked here only against a stand-in server speaking that wire format (see the rollout README).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from unirl_core.errors import ConfigError, check_ints, field_error
from unirl_core.rollout.dedicated import PromptFormat

SGLangDType = Literal["auto", "float32", "bfloat16", "float16"]
WeightSync = Literal["reload", "lora"]

PYTHON_ENV = "UNIRL_SGLANG_PYTHON"
"""Environment variable naming the interpreter that has SGLang installed."""


def default_python() -> str:
    """``$UNIRL_SGLANG_PYTHON``, else the repo's ``.venv-sglang``, else this Python."""
    env = os.environ.get(PYTHON_ENV)
    if env:
        return env
    repo_venv = Path(__file__).resolve().parents[3] / ".venv-sglang" / "bin" / "python"
    return str(repo_venv) if repo_venv.exists() else sys.executable


@dataclass(frozen=True, kw_only=True)
class SGLangEngineConfig:
    """Where the SGLang server runs, how it is started, and how weights reach it after a publish."""

    model: str
    """Model directory or hub id the server loads at start (``--model-path``)."""
    tokenizer: str | None = None
    """Tokenizer used HERE to encode prompts (token-in); None uses ``model``'s. Must be the trainer's."""
    base_url: str | None = None
    """Attach to a running server instead of starting one (it must not set SGLANG_RETURN_ORIGINAL_LOGPROB)."""
    python: str | None = None
    """Interpreter that has SGLang installed; None uses ``default_python()``."""
    host: str = "127.0.0.1"
    """Interface the started server binds."""
    port: int = 0
    """HTTP port of the started server; 0 reserves a free one."""
    dtype: SGLangDType = "auto"
    """Weight/activation dtype on the server."""
    context_length: int | None = None
    """Longest prompt + completion (``--context-length``); None uses the model's."""
    mem_fraction_static: float | None = None
    """Accelerator memory fraction for weights + KV cache; lower it when colocated (e.g. 0.3-0.5)."""
    colocate: bool = False
    """Start with ``--enable-memory-saver`` so release/resume_memory_occupation really free memory
    (without it SGLang answers success and frees nothing)."""
    deterministic: bool = False
    """``--enable-deterministic-inference``: SGLang honours per-request sampling seeds only with it."""
    weight_sync: WeightSync = "reload"
    """``reload``: ``/update_weights_from_disk`` after each publish; ``lora``: load an adapter per publish."""
    max_lora_rank: int = 16
    """Largest adapter rank (``weight_sync='lora'``)."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Modules adapters may target (``--lora-target-modules``)."""
    lora_alpha: float | None = None
    """Alpha written into the adapter config when publishing a LoRA checkpoint ref."""
    staging_dir: str | None = None
    """Folder where checkpoint refs are unpacked for the server (must be visible to it)."""
    prompt: PromptFormat = field(default_factory=PromptFormat)
    """Chat-template rule used to encode prompts; keep it equal to the trainside engine's."""
    max_concurrency: int = 64
    """Requests in flight at once."""
    startup_timeout_s: float = 900.0
    """Seconds to wait for ``/health_generate``."""
    request_timeout_s: float = 600.0
    """Seconds one HTTP request may take."""
    extra_args: tuple[str, ...] = ()
    """Extra server arguments (``--tp-size 2``, ``--attention-backend fa3``, ...)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the server process."""
    log_dir: str | None = None
    """Folder of the server log; None uses a temporary folder."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise field_error(ConfigError, "sglang.model", self.model, "a model directory or hub id",
                              "save the policy with save_pretrained(dir) and pass dir")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise field_error(ConfigError, "sglang.base_url", self.base_url, "an http(s):// URL or None",
                              "e.g. http://127.0.0.1:30000, or None to start a server")
        if not (isinstance(self.port, int) and 0 <= self.port < 65536):
            raise field_error(ConfigError, "sglang.port", self.port, "an integer in [0, 65536)", "use 0")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise field_error(ConfigError, "sglang.dtype", self.dtype, "auto, float32, bfloat16 or float16",
                              "pick a supported dtype")
        if self.weight_sync not in ("reload", "lora"):
            raise field_error(ConfigError, "sglang.weight_sync", self.weight_sync, "'reload' or 'lora'", "pick one")
        if self.mem_fraction_static is not None and not (0 < self.mem_fraction_static < 1):
            raise field_error(ConfigError, "sglang.mem_fraction_static", self.mem_fraction_static,
                              "a fraction in (0, 1) or None", "size it from the wake-up peak, e.g. 0.4")
        check_ints("sglang", self, ("max_lora_rank", "max_concurrency"), "use a positive size")
        if self.context_length is not None and not (isinstance(self.context_length, int) and self.context_length >= 2):
            raise field_error(ConfigError, "sglang.context_length", self.context_length, "an integer >= 2 or None",
                              "use the model's context length")
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))
        reserved = {"--model-path", "--port", "--host"}
        clash = [a for a in self.extra_args if a.split("=")[0] in reserved]
        if clash:
            raise field_error(ConfigError, "sglang.extra_args", clash, f"none of {sorted(reserved)}",
                              "set these through the typed fields; the engine relies on their values")
