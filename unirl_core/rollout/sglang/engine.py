"""SGLang rollout engine: token-in / token-out ``/generate`` against an SGLang server.

Endpoints (SGLang's native HTTP API):

- ``POST /generate`` with ``input_ids``, ``sampling_params``, ``return_logprob=true``,
  ``logprob_start_len=-1`` (output tokens only); the answer's ``meta_info`` carries
  ``output_token_logprobs`` (``[logprob, token_id, text]`` per sampled token), ``finish_reason``
  and ``weight_version`` (the label set by the last weight update);
- ``POST /update_weights_from_disk`` (``model_path``, ``weight_version``, ``flush_cache``): full publish;
- ``POST /load_lora_adapter`` / ``/unload_lora_adapter``: LoRA publish (requests name ``lora_path``);
- ``POST /release_memory_occupation`` / ``/resume_memory_occupation``: colocated sleep / wake;
- ``GET /health_generate``: readiness; ``GET /get_model_info``: the served weight version.

Log-probs: SGLang reports ``log_softmax(logits / temperature)`` of the sampled token (before
top-k/top-p) unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set; the engine removes that variable
from the server environment so the values are the ones the trainer replays.

NOT RUN HERE: SGLang has no CPU build. This module is tested against a stand-in HTTP server that
speaks the documented wire format (tests/unit/rollout/test_sglang_wire.py), not against SGLang.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from unirl_core.errors import EngineError, field_error
from unirl_core.rollout.dedicated import (
    Completion,
    ar_parts,
    encode_prompt,
    eos_token_ids,
    collect,
    connect_server,
    post_all,
    request_seed,
    run_requests,
    to_finish_reason,
)
from unirl_core.rollout.server import ManagedServer
from unirl_core.rollout.sglang.config import SGLangEngineConfig, default_python
from unirl_core.rollout.weights import stage_weights
from unirl_core.types import ARSamplingParams, NoiseRecipe, SampleBatch

logger = logging.getLogger(__name__)


def server_argv(cfg: SGLangEngineConfig, python: str, port: int) -> list[str]:
    """Command line of ``python -m sglang.launch_server``."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", cfg.model, "--host", cfg.host,
            "--port", str(port), "--dtype", cfg.dtype, "--skip-server-warmup"]
    if cfg.tokenizer:
        argv += ["--tokenizer-path", cfg.tokenizer]
    if cfg.context_length is not None:
        argv += ["--context-length", str(cfg.context_length)]
    if cfg.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.colocate:
        argv.append("--enable-memory-saver")
    if cfg.deterministic:
        argv.append("--enable-deterministic-inference")
    if cfg.weight_sync == "lora":
        argv += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank),
                 "--lora-target-modules", *cfg.lora_target_modules]
    return argv + list(cfg.extra_args)


def server_env(cfg: SGLangEngineConfig) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_RETURN_ORIGINAL_LOGPROB"}
    env.update(cfg.env)
    if "SGLANG_RETURN_ORIGINAL_LOGPROB" in cfg.env:
        raise field_error(EngineError, "sglang.env.SGLANG_RETURN_ORIGINAL_LOGPROB", cfg.env[
            "SGLANG_RETURN_ORIGINAL_LOGPROB"], "unset", "it makes SGLang report pre-temperature log-probs")
    return env


def sampling_body(sp: ARSamplingParams, seed: int | None) -> dict:
    """SGLang ``sampling_params`` of one request (top_k=-1 disables it in SGLang)."""
    body = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k if sp.top_k > 0 else -1,
            "max_new_tokens": sp.max_new_tokens}
    if sp.stop:
        body["stop"] = list(sp.stop)
    if seed is not None:
        body["sampling_seed"] = seed
    return body


def parse_generate(resp: object, where: str) -> Completion:
    """One ``/generate`` answer -> ``Completion`` (ids and log-probs from ``output_token_logprobs``)."""
    try:
        meta = resp["meta_info"]
        triples = meta["output_token_logprobs"]
        ids = [int(t[1]) for t in triples]
        logps = [float(t[0]) for t in triples]
        label = str(meta["weight_version"])
        finish = meta.get("finish_reason")
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise field_error(EngineError, where, str(resp)[:300], "a /generate answer with meta_info.output_token_logprobs",
                          f"request return_logprob=true and check the SGLang version ({e!r})") from None
    out_ids = resp.get("output_ids")
    if out_ids is not None and [int(t) for t in out_ids] != ids:
        raise field_error(EngineError, f"{where}.output_ids", len(out_ids), f"the {len(ids)} log-prob token ids",
                          "set logprob_start_len=-1 so log-probs cover exactly the output tokens")
    if not label.lstrip("-").isdigit():
        raise field_error(EngineError, f"{where}.meta_info.weight_version", label, "an integer policy version",
                          "let the engine label the server before generating")
    return Completion(response_ids=ids, log_probs=logps, policy_version=int(label),
                      finish_reason=to_finish_reason(finish, f"{where}.finish_reason"))


class SGLangEngine:
    """``RolloutEngine`` over an SGLang server; stamps every Part with the version SGLang reports."""

    def __init__(self, config: SGLangEngineConfig, *, policy_version: int = 0, tokenizer=None) -> None:
        from unirl_core.models.tokenizer import load_tokenizer

        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer or config.model)
        self.eos_ids = eos_token_ids(self.tokenizer, config.model if os.path.isdir(config.model) else None)
        self._lock = threading.Lock()
        self._lora_name: str | None = None
        self._staging = Path(config.staging_dir or tempfile.mkdtemp(prefix="unirl-sglang-weights-"))
        self.server: ManagedServer | None = None
        self.last_sync_s: float | None = None
        self.client, self.server = connect_server(
            config, name="sglang", health_path="/health_generate",
            argv=lambda py, port: server_argv(config, py, port), env=server_env(config),
            default_python=default_python)
        self.policy_version = int(policy_version)
        try:
            self._label(self.policy_version)
        except BaseException:
            self.close()
            raise

    def generate(self, batch: SampleBatch, *, noise: NoiseRecipe | None = None) -> SampleBatch:
        """Sample every AR Part; ``noise`` is unused."""
        parts = ar_parts(batch)
        cache: dict[str, Tensor] = {}
        prompts = []
        for p in parts:
            if p.prompt not in cache:
                cache[p.prompt] = encode_prompt(self.tokenizer, p.prompt, self.config.prompt)
            prompts.append(cache[p.prompt])
        tag = uuid.uuid4().hex[:8]
        bodies = []
        for p, ids in zip(parts, prompts):
            sp = p.sampling or ARSamplingParams()
            body = {"input_ids": ids.tolist(), "sampling_params": sampling_body(sp, request_seed(sp, p.sample_id)),
                    "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0,
                    "rid": f"{p.sample_id}@v{self.policy_version}-{tag}"}
            if self._lora_name is not None:
                body["lora_path"] = self._lora_name
            bodies.append(body)
        done = run_requests(self._lock, self.server, lambda: self._post_all(bodies))
        return collect(batch, prompts, done, policy_version=self.policy_version, tokenizer=self.tokenizer,
                       eos_ids=self.eos_ids)

    def _post_all(self, bodies: Sequence[dict]) -> list[Completion]:
        def one(i: int, body: dict) -> Completion:
            return parse_generate(self.client.post("/generate", body), f"sglang.generate[{i}]")

        return post_all(one, bodies, max_concurrency=self.config.max_concurrency, name="sglang")

    def update_weights(self, path_or_ref: object, policy_version: int) -> float:
        """Serve the published weights as ``policy_version``; returns the wall seconds it took."""
        t0 = time.perf_counter()
        version = int(policy_version)
        folder = stage_weights(path_or_ref, want="lora" if self.config.weight_sync == "lora" else "full",
                               staging=self._staging, policy_version=version, lora_alpha=self.config.lora_alpha,
                               base_model=self.config.model)
        with self._lock:
            if self.config.weight_sync == "lora":
                name = f"policy-v{version}"
                self._check_ok(self.client.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}),
                               "load_lora_adapter")
                old, self._lora_name = self._lora_name, name
                self._label(version)
                if old is not None and old != name:
                    self.client.post("/unload_lora_adapter", {"lora_name": old})
            else:
                self._check_ok(self.client.post("/update_weights_from_disk", {
                    "model_path": str(folder), "weight_version": str(version), "flush_cache": True}),
                    "update_weights_from_disk")
            self.policy_version = version
        self.last_sync_s = time.perf_counter() - t0
        logger.info("sglang serves policy v%d from %s (%.2f s)", version, folder, self.last_sync_s)
        return self.last_sync_s

    @staticmethod
    def _check_ok(resp: object, what: str) -> None:
        if isinstance(resp, dict) and resp.get("success") is False:
            raise field_error(EngineError, f"sglang.{what}", resp.get("message"), "success",
                              "check that the folder matches the served architecture")

    def _label(self, version: int) -> None:
        self._check_ok(self.client.post("/update_weight_version", {"new_version": str(version)}),
                       "update_weight_version")

    def served_version(self) -> int:
        """The weight version SGLang reports now (``GET /get_model_info``)."""
        return int(self.client.get("/get_model_info")["weight_version"])

    def sleep(self, level: int = 1) -> None:
        """Release weights and KV cache (needs ``colocate=True``: ``--enable-memory-saver``)."""
        if not self.config.colocate:
            raise field_error(EngineError, "sglang.colocate", False, "True to release memory",
                              "without --enable-memory-saver SGLang reports success and frees nothing")
        self.client.post("/release_memory_occupation", {})

    def wake_up(self) -> None:
        self.client.post("/resume_memory_occupation", {})

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
