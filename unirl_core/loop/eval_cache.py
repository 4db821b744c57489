"""Held-out evaluations cached by content: the key is the evaluated weights' digest and the evaluation protocol.

An evaluation is deterministic (``unirl_core.loop.evaluate``: fixed prompts, ODE / greedy sampling from a fixed
seed), so its result is a function of the weights and of how they are evaluated - not of the run or step that holds
them. Two forks share their parent's prefix; evaluating the fork's start version, or the parent's version k again,
or any unchanged version twice, costs one read. The key:

- **weights**: the sha256 of the version's weights as the store records them (``Manifest.weights_sha256``: the
  safetensors encoding, also for a delta version) or of its ``ema.safetensors`` for ``eval.weights: ema``;
- **protocol**: sha256 of the JSON of what turns weights into the numbers - the eval prompts (texts and targets),
  samples per prompt, seed, the sampling params, the reward section and the algorithm's reward shaping (DAPO's overlong
  penalty), the model section (for an adapter the base model; the architecture it loads into), the engine section,
  the agent section (multi-turn episodes), the family - and of the process's float order (torch
  version and intra-op threads: another thread count adds floats in another order) and of the code: the sha256 of
  the library's source files and of the recipe's plugins' (``code_digest``), so a changed scorer, sampler or eval
  path computes anew instead of reading a number the old code produced. A device (GPU model, CUDA) is not in the
  key: entries computed on different accelerators under one root are shared.

Entries live at ``<checkpoint.root>/.evals/<key>.json`` (the metrics, the digests, the protocol, where and when it
was computed) and ``<key>.arrow`` (the scored batch, per-column checksums), shared by every run under the root.
A read that fails (damaged, foreign) is a miss, said at WARNING; the entry is rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import posixpath
import tempfile
import time
import uuid
from pathlib import Path

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from unirl_core.checkpoint import CheckpointRef, load_manifest
from unirl_core.checkpoint.store import EMA, WEIGHTS
from unirl_core.config.loader import to_dict
from unirl_core.errors import ConfigError, SchemaError, field_error
from unirl_core.io.ipc import read_batch, write_batch
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

EVAL_CACHE_DIR = ".evals"


def weights_digest(cfg, ckpt: CheckpointRef, weights: str) -> str:
    """The digest of the weights an evaluation of ``ckpt`` samples with (policy or EMA)."""
    manifest = load_manifest(ckpt, storage_options=cfg.checkpoint.storage_options)
    digest = manifest.weights_sha256(WEIGHTS) if weights == "policy" else \
        (manifest.files.get(EMA) or {}).get("sha256")
    if digest is None:
        raise field_error(ConfigError, "eval.weights", weights, f"weights that version {ckpt.uri} holds (it has no "
                          f"{EMA})", "evaluate policy weights, or set train.ema_decay (e.g. 0.9) so versions carry "
                          "EMA weights")
    return str(digest)


PROTOCOL_VERSION = 1
"""Raise it when ``evaluate.eval_phase`` changes what it computes from the same inputs (e.g. ``eval_sampling``)."""


def protocol(cfg, prompts: list, weights: str) -> dict:
    """What turns a version's weights into eval numbers (JSON data), besides the weights themselves: known before
    any model is built (the eval's sampling params derive from ``sampling`` and the model's family, which the model
    section names)."""
    section = cfg.section
    return {"version": PROTOCOL_VERSION, "family": cfg.family, "weights": weights,
            "prompts": [[p.prompt, dict(p.targets)] for p in prompts],
            "samples_per_prompt": cfg.eval.samples_per_prompt, "seed": cfg.eval.seed,
            "sampling": to_dict(section.sampling), "reward": to_dict(cfg.reward),
            "model": to_dict(section.model), "engine": to_dict(section.engine),
            "agent": to_dict(getattr(section, "agent", None)), "reward_shaping": _reward_shaping(cfg),
            "float_order": {"torch": torch.__version__, "threads": torch.get_num_threads()},
            "code": code_digest(tuple(getattr(cfg, "plugins", ()) or ()))}


@functools.lru_cache(maxsize=None)
def code_digest(plugins: tuple[str, ...] = ()) -> str:
    """sha256 over the source files of ``unirl_core`` and of the named plugin modules (a package: all its ``.py``
    files), by path relative to their root and content; computed once per process and plugin list."""
    import unirl_core

    roots = [Path(unirl_core.__file__).parent]
    for name in plugins:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            origin = Path(spec.origin)
            roots.append(origin.parent if origin.name == "__init__.py" else origin)
    h = hashlib.sha256()
    for root in roots:
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for f in files:
            h.update(str(f.relative_to(root.parent)).encode() + b"\0")
            h.update(f.read_bytes())
    return h.hexdigest()


def _reward_shaping(cfg) -> dict:
    """The algorithm's settings ``reward_phase`` shapes the eval's rewards with (``runtime.steps.shape_rewards``:
    DAPO's overlong penalty), none when it shapes nothing."""
    algo = cfg.section.algorithm if cfg.family == "lm" else None
    if getattr(algo, "overlong_buffer_len", None) is None:
        return {}
    return {"overlong_buffer_len": algo.overlong_buffer_len, "overlong_penalty_factor": algo.overlong_penalty_factor}


def digest_of(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


class EvalCache:
    """Cached evaluations under a checkpoint root (``<root>/.evals/``)."""

    def __init__(self, root: str, *, storage_options: dict | None = None) -> None:
        self.fs, path = fsspec.core.url_to_fs(root, **dict(storage_options or {}))
        self.path = posixpath.join(path.rstrip("/"), EVAL_CACHE_DIR)
        self.local = isinstance(self.fs, LocalFileSystem)

    def _file(self, key: str, suffix: str) -> str:
        return posixpath.join(self.path, key + suffix)

    def get(self, key: str) -> tuple[SampleBatch, dict] | None:
        """The cached batch and record of ``key``; None when there is none (or it does not read back)."""
        record_path, batch_path = self._file(key, ".json"), self._file(key, ".arrow")
        try:
            record = json.loads(self.fs.cat_file(record_path))
        except FileNotFoundError:
            return None
        except ValueError as e:
            log.warning("ignoring damaged eval cache entry %s: %s", record_path, e)
            return None
        if not isinstance(record, dict) or not isinstance(record.get("metrics"), dict):
            log.warning("ignoring eval cache entry %s: it holds no metrics", record_path)
            return None
        try:
            if self.local:
                batch = read_batch(batch_path, verify=True)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    local = os.path.join(tmp, "eval.arrow")
                    self.fs.get_file(batch_path, local)
                    batch = read_batch(local, memory_map=False, verify=True)
        except (SchemaError, FileNotFoundError) as e:
            log.warning("ignoring eval cache entry %s: its batch does not read back (%s)", record_path, e)
            return None
        return batch, record

    def put(self, key: str, batch: SampleBatch, record: dict) -> None:
        """Store an evaluation: the batch first, the record last (a record names a complete entry)."""
        self.fs.makedirs(self.path, exist_ok=True)
        if self.local:
            write_batch(batch, self._file(key, ".arrow"))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                local = os.path.join(tmp, "eval.arrow")
                write_batch(batch, local)
                self.fs.put_file(local, self._file(key, ".arrow"))
        body = json.dumps({**record, "key": key, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                          sort_keys=True, indent=1, default=str).encode()
        if self.local:
            tmp = self._file(key, f".json.{uuid.uuid4().hex}.tmp")  # pods on one volume may share a pid
            with open(tmp, "wb") as f:
                f.write(body)
            os.replace(tmp, self._file(key, ".json"))
        else:
            self.fs.pipe_file(self._file(key, ".json"), body)
