"""Preflight: cheap checks that a run can reach what it needs, before any GPU pod starts.

- ``checkpoint.root`` is writable: a small probe object ``<root>/<run>/.preflight-<random>`` is written and
  deleted (local directory or ``s3://``, with ``checkpoint.storage_options``); a local run folder it created is
  removed again, a root folder it created stays (runs share it);
- the prompt set (``data.source: file``) is there: ``data.file.path`` (a local path, any fsspec URL or a hub dataset
  id) exists, has a known format, is not empty and its first rows carry the prompt field;
- the model is reachable: a local directory exists, or a hub id answers ``huggingface_hub.auth_check``
  (found, and not gated for this token); with ``HF_HUB_OFFLINE=1`` the hub is not asked and the model must
  be in the local cache instead. Tiny presets always pass.

Every check is bounded in time (``timeout`` seconds each) and fails with a ``ConfigError`` that names the
field, the value and the fix. ``UNIRL_PREFLIGHT_NETWORK=0`` skips the hub check (a note says so), e.g. when
the pods read the hub through a mirror the setup pod cannot see.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import uuid
from collections.abc import Callable
from typing import Any

from unirl_core.config.run import RunConfig
from unirl_core.data.prompts import check_columns, check_prompts_per_step
from unirl_core.data.prompts import where as prompt_where
from unirl_core.data.uri import probe_rows
from unirl_core.errors import ConfigError, field_error
from unirl_core.models.diffusion import is_preset
from unirl_core.models.presets import tokenizer_preset
from unirl_core.rollout.vllm.config import PYTHON_ENV, default_python

NETWORK_ENV = "UNIRL_PREFLIGHT_NETWORK"
DEFAULT_TIMEOUT = 20.0
LOCAL_ROOT_FIX = "pass --overrides '[\"checkpoint.root=runs\"]' for a local run"
# what shipped cluster recipes carry until a user names their bucket
PLACEHOLDER_ROOTS = ("s3://my-bucket/",)

_TINY_LM = ("tiny",)
_TINY_TOKENIZERS = ("tiny", "qwen2.5")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def preflight(cfg: RunConfig, *, timeout: float = DEFAULT_TIMEOUT, network: bool | None = None,
              engines_here: bool = True) -> list[str]:
    """Run every check of ``cfg``; returns notes about checks that were skipped (empty when all ran).
    ``network``: ask the hub about hub ids (None: unless ``UNIRL_PREFLIGHT_NETWORK=0``). ``engines_here``: a
    dedicated engine the run starts starts on this machine (its interpreter is checked)."""
    check_checkpoint_root(cfg, timeout=timeout)
    check_prompt_data(cfg, timeout=timeout)
    if engines_here:
        check_vllm_python(cfg, timeout=timeout)
    return check_models(cfg, timeout=timeout, network=network)


def check_vllm_python(cfg: RunConfig, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """A run that starts its own vLLM server (``lm.deployment.engine: vllm`` without ``lm.vllm.base_url``) needs an
    interpreter with vLLM installed: refused now, naming the field and the install script, not when the server
    dies at its start with ``No module named 'vllm'``."""
    if cfg.family != "lm" or cfg.lm.deployment.engine != "vllm" or cfg.lm.vllm is None or cfg.lm.vllm.base_url:
        return
    python = cfg.lm.vllm.python or default_python()
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise field_error(ConfigError, "lm.vllm.python", cfg.lm.vllm.python,
                          f"an interpreter with vLLM installed (this run would start {python}, which has none)",
                          f"run `bash scripts/install_vllm.sh` (it makes .venv-vllm, used by default), or set "
                          f"lm.vllm.python / ${PYTHON_ENV} to one that has vLLM")


def _bounded(fn: Callable[[], Any], timeout: float) -> tuple[bool, BaseException | None]:
    """Run ``fn`` in a daemon thread: (finished in time, its exception or None)."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (reported to the caller)
            box[0] = e

    t = threading.Thread(target=run, name="unirl-preflight", daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), box[0]


def _why(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 300 else text[:300] + "..."


def _storage_options(cfg: RunConfig, url: str) -> dict[str, Any]:
    opts = dict(cfg.checkpoint.storage_options)
    if url.startswith(("s3://", "s3a://")):
        # fail in seconds, not after botocore's retries with backoff; the user's own settings win
        config_kwargs = {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 2}}
        config_kwargs.update(opts.get("config_kwargs") or {})
        opts["config_kwargs"] = config_kwargs
    return opts


def check_checkpoint_root(cfg: RunConfig, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Write and delete ``<checkpoint.root>/<name>/.preflight-<random>``; ConfigError naming
    ``checkpoint.root`` when that fails or takes longer than ``timeout`` seconds."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    root = cfg.checkpoint.root
    placeholder = root.startswith(PLACEHOLDER_ROOTS)
    if "://" in root and not root.startswith("file://"):
        fix = ("set checkpoint.root to a bucket you can write (S3 credentials from the environment, e.g. "
               "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or checkpoint.storage_options), or " + LOCAL_ROOT_FIX)
    else:
        fix = "set checkpoint.root to a directory this process can create and write"
    if placeholder:
        fix = "the recipe's root is a placeholder: " + fix

    def probe() -> None:
        fs, path = fsspec.core.url_to_fs(root, **_storage_options(cfg, root))
        run_dir = f"{path.rstrip('/')}/{cfg.name}"
        name = f"{run_dir}/.preflight-{uuid.uuid4().hex[:12]}"
        created = False
        if isinstance(fs, LocalFileSystem):
            # a local root: create the run folder like the store would, and remove it again if it was new. A root
            # folder it created stays: other runs share it, and one starting now may be creating its own run
            # folder in it (removing the root under it failed that run with ENOENT)
            created = not fs.exists(run_dir)
            fs.makedirs(run_dir, exist_ok=True)
        fs.pipe_file(name, b"unirl preflight probe\n")
        fs.rm_file(name)
        if created:
            try:
                fs.rmdir(run_dir)
            except OSError:  # not empty: something of this run's was written meanwhile, and stays
                pass

    done, err = _bounded(probe, timeout)
    if not done:
        raise field_error(ConfigError, "checkpoint.root", root,
                          f"a store this process can write within {timeout:g} s (the probe write did not return)",
                          fix)
    if err is not None:
        raise field_error(ConfigError, "checkpoint.root", root,
                          f"a store this process can write (writing a probe under {root.rstrip('/')}/{cfg.name}/ "
                          f"failed: {_why(err)})", fix) from err


def check_prompt_data(cfg: RunConfig, *, timeout: float = DEFAULT_TIMEOUT) -> None:
    """``data.source: file``: the prompt set at ``data.file.path`` (any fsspec URI or a hub dataset id) exists, has
    a known format, is not empty, its first rows parse and carry ``prompt_field`` / ``answer_field``, and (when the
    probe read all of it) holds at least ``data.prompts_per_step`` prompts. Reads the head of a large file only.
    A ``ConfigError`` names the field, the URI and what was found (``unirl_core/data/uri.py``)."""
    if cfg.data.source != "file":
        return
    file = cfg.data.file
    box: list = []
    done, err = _bounded(lambda: box.append(probe_rows(prompt_where(file))), timeout)
    if not done:
        raise field_error(ConfigError, "data.file.path", file.path, f"a prompt set readable within {timeout:g} s",
                          "found: no answer in time; check the network, the endpoint and the credentials")
    if err is not None:
        if isinstance(err, ConfigError):
            raise err
        raise field_error(ConfigError, "data.file.path", file.path, "a readable prompt set",
                          f"found: {_why(err)}; check the URI and the credentials") from err
    rows, whole = box[0]
    check_columns(file, rows)
    if whole:
        check_prompts_per_step(cfg.data.prompts_per_step, len(rows), f"data.file.path={file.path!r}")


def _model_fields(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """(field, value, file that marks a downloaded snapshot) of every model the run loads, tiny presets left out."""
    if cfg.family == "diffusion":
        src = cfg.diffusion.model.source
        return [] if is_preset(src) else [("diffusion.model.source", src, "model_index.json")]
    out = []
    lm = cfg.lm.model
    if lm.model not in _TINY_LM:
        out.append(("lm.model.model", lm.model, "config.json"))
    if (lm.tokenizer is not None and lm.tokenizer not in _TINY_TOKENIZERS and tokenizer_preset(lm.tokenizer) is None
            and lm.tokenizer != lm.model):
        out.append(("lm.model.tokenizer", lm.tokenizer, "tokenizer_config.json"))
    return out


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def check_models(cfg: RunConfig, *, timeout: float = DEFAULT_TIMEOUT, network: bool | None = None) -> list[str]:
    """Each model of ``cfg``: a local directory that exists, or a hub id that is reachable (or cached when
    ``HF_HUB_OFFLINE=1``). Returns notes about skipped checks."""
    if network is None:
        network = os.environ.get(NETWORK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    notes: list[str] = []
    for field, value, marker in _model_fields(cfg):
        if os.path.isdir(os.path.expanduser(value)):
            continue
        if not _HUB_ID.match(value):
            parts = value.rstrip("/").split("/")
            fix = ("fix the path (relative paths start at the task's working directory) or name a tiny preset for "
                   "an offline run")
            if len(parts) >= 2 and parts[-1] == "export":  # <checkpoint.root>/<run>/export: an SFT run's export
                fix = (f"it is the export of SFT run {parts[-2]!r}, which is not there yet: train it first "
                       f"(`python -m unirl_core.sft --recipe {parts[-2]}` exports to <its checkpoint.root>/"
                       f"{parts[-2]}/export), "
                       f"or {fix}")
            raise field_error(ConfigError, field, value, "an existing local model directory or a hub id (org/name)",
                              fix)
        if _offline():
            if not _in_hub_cache(value, marker):
                raise field_error(ConfigError, field, value,
                                  "a hub model in the local cache, since HF_HUB_OFFLINE is set",
                                  "download it first (huggingface-cli download <id>) into HF_HOME, or unset "
                                  "HF_HUB_OFFLINE")
            continue
        if not network:
            notes.append(f"{field}={value!r}: hub check skipped ({NETWORK_ENV}=0)")
            continue
        _check_hub(field, value, timeout)
    return notes


def _in_hub_cache(repo_id: str, marker: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, marker), str)


def _check_hub(field: str, repo_id: str, timeout: float) -> None:
    from huggingface_hub import auth_check
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    done, err = _bounded(lambda: auth_check(repo_id), timeout)
    if not done:
        raise field_error(ConfigError, field, repo_id, f"a hub model that answers within {timeout:g} s",
                          "check the network / HF_ENDPOINT, or set HF_HUB_OFFLINE=1 with the model cached "
                          f"(or {NETWORK_ENV}=0 to skip this check)")
    if isinstance(err, GatedRepoError):
        raise field_error(ConfigError, field, repo_id, "a hub model this token may download (it is gated)",
                          "accept its licence on the hub and set HF_TOKEN (in the pods too, e.g. a Flyte secret)") \
            from err
    if isinstance(err, RepositoryNotFoundError):
        raise field_error(ConfigError, field, repo_id, "an existing local directory or hub model",
                          "fix the id (org/name), or set HF_TOKEN if the repository is private") from err
    if err is not None:
        raise field_error(ConfigError, field, repo_id, f"a reachable hub model ({_why(err)})",
                          "check the network / HF_ENDPOINT, or set HF_HUB_OFFLINE=1 with the model cached "
                          f"(or {NETWORK_ENV}=0 to skip this check)") from err
