"""Configuration of the vLLM rollout engine (an OpenAI-compatible vLLM server in its own process)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from unirl_core.errors import ConfigError, check_ints, field_error
from unirl_core.rollout.dedicated import PromptFormat

VLLMDType = Literal["auto", "float32", "bfloat16", "float16"]
WeightSync = Literal["reload", "lora"]

PYTHON_ENV = "UNIRL_VLLM_PYTHON"
"""Environment variable naming the interpreter that has vLLM installed (overrides the default)."""


def default_python() -> str:
    """``$UNIRL_VLLM_PYTHON``, else the repo's ``.venv-vllm`` (scripts/install_vllm.sh), else this Python."""
    env = os.environ.get(PYTHON_ENV)
    if env:
        return env
    repo_venv = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
    return str(repo_venv) if repo_venv.exists() else sys.executable


@dataclass(frozen=True, kw_only=True)
class VLLMEngineConfig:
    """Where the vLLM server runs, how it is started, and how weights reach it after a publish."""

    model: str | None = None
    """Model directory (``save_pretrained`` layout) or hub id the server loads at start. None is only valid
    inside the training loop, which starts the server from the run's exported step-0 policy
    (``unirl_core.runtime.build.initial_policy_uri``); a standalone engine needs a directory or hub id."""
    tokenizer: str | None = None
    """Tokenizer used HERE to encode prompts (token-in); None uses ``model``'s. Must be the trainer's."""
    base_url: str | None = None
    """Attach to a running server (``http://host:port``) instead of starting one; start it with the
    flags and environment of ``unirl_core.rollout.vllm.engine.server_argv`` / ``server_env``."""
    python: str | None = None
    """Interpreter that has vLLM installed; None uses ``default_python()``."""
    host: str = "127.0.0.1"
    """Interface the started server binds."""
    port: int = 0
    """Port of the started server; 0 reserves a free one."""
    served_model_name: str = "policy"
    """Name requests address the base model by."""
    dtype: VLLMDType = "auto"
    """Weight/activation dtype on the server; ``auto`` keeps the checkpoint's (fp32 tiny models stay fp32)."""
    max_model_len: int = 2048
    """Longest prompt + completion; a request past it fails before it is sent."""
    enforce_eager: bool = True
    """Skip CUDA graphs / torch.compile (required on CPU; set False on GPUs for speed)."""
    gpu_memory_utilization: float | None = None
    """Fraction of accelerator memory vLLM may take; lower it when colocated with training. None = vLLM's."""
    cpu_kv_cache_gib: int = 1
    """KV cache size on the CPU backend (``VLLM_CPU_KVCACHE_SPACE``); ignored on GPUs."""
    seed: int = 0
    """Server seed (requests without a seed draw from it)."""
    weight_sync: WeightSync = "reload"
    """``reload``: full weights are reloaded in place from a directory after each publish;
    ``lora``: each publish loads a LoRA adapter and requests address it by name."""
    max_lora_rank: int = 16
    """Largest adapter rank the server accepts (``weight_sync='lora'``)."""
    lora_alpha: float | None = None
    """Alpha written into the adapter config when publishing a LoRA checkpoint ref (peft's ``lora_alpha``)."""
    staging_dir: str | None = None
    """Folder where checkpoint refs are unpacked for the server to load (must be visible to it);
    None uses a temporary folder."""
    prompt: PromptFormat = field(default_factory=PromptFormat)
    """Chat-template rule used to encode prompts; keep it equal to the trainside engine's."""
    ignore_eos: bool = False
    """Keep sampling past EOS until ``max_new_tokens`` (throughput benchmarks only)."""
    max_concurrency: int = 64
    """Requests in flight at once (the server batches them)."""
    startup_timeout_s: float = 600.0
    """Seconds to wait for the started server's health endpoint."""
    request_timeout_s: float = 600.0
    """Seconds one HTTP request may take."""
    extra_args: tuple[str, ...] = ()
    """Extra command-line arguments for the server (``--tensor-parallel-size 2``, ...)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the server process."""
    log_dir: str | None = None
    """Folder of the server log; None uses a temporary folder (its path is logged)."""

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise field_error(ConfigError, "vllm.model", self.model, "a model directory, a hub id or None",
                              "save the policy with save_pretrained(dir) and pass dir (None: the loop's export)")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise field_error(ConfigError, "vllm.base_url", self.base_url, "an http(s):// URL or None",
                              "e.g. http://127.0.0.1:8000, or None to start a server")
        if not (isinstance(self.port, int) and 0 <= self.port < 65536):
            raise field_error(ConfigError, "vllm.port", self.port, "an integer in [0, 65536)", "use 0 for a free port")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise field_error(ConfigError, "vllm.dtype", self.dtype, "auto, float32, bfloat16 or float16",
                              "use float32 for the tightest log-prob agreement")
        if self.weight_sync not in ("reload", "lora"):
            raise field_error(ConfigError, "vllm.weight_sync", self.weight_sync, "'reload' or 'lora'", "pick one")
        check_ints("vllm", self, ("max_model_len", "max_lora_rank", "max_concurrency", "cpu_kv_cache_gib"),
                   "use a positive size")
        if self.gpu_memory_utilization is not None and not (0 < self.gpu_memory_utilization <= 1):
            raise field_error(ConfigError, "vllm.gpu_memory_utilization", self.gpu_memory_utilization,
                              "a fraction in (0, 1] or None", "use e.g. 0.4 when colocated with training")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise field_error(ConfigError, "vllm.lora_alpha", self.lora_alpha, "a value > 0 or None",
                              "use the trainer's LoRA alpha")
        for name in ("startup_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise field_error(ConfigError, f"vllm.{name}", getattr(self, name), "a value > 0", "use seconds")
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        reserved = {"--model", "--port", "--host", "--logprobs-mode", "--served-model-name"}
        clash = [a for a in self.extra_args if a.split("=")[0] in reserved]
        if clash:
            raise field_error(ConfigError, "vllm.extra_args", clash, f"none of {sorted(reserved)}",
                              "set these through the typed fields; the engine relies on their values")
