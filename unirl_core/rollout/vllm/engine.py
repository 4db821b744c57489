"""vLLM rollout engine: token-in / token-out generation against a vLLM server in its own process.

Why a server and not an in-process ``vllm.LLM``: vLLM pins its own torch / transformers / numba
versions, so it lives in its own virtual environment (scripts/install_vllm.sh) and the trainer
never imports it. The same engine then attaches to a server pool on other machines (``base_url``).

Endpoints used (vLLM 0.32, all present when started with ``VLLM_SERVER_DEV_MODE=1`` and
``--enable-scale-out``):

- ``POST /inference/v1/generate``: prompt token ids in, sampled token ids + the sampled tokens'
  log-probs out, plus ``weight_versions`` spans naming the weights that produced each token;
- ``POST /pause`` / ``/resume``, ``/collective_rpc`` (our worker extension: ``unirl_reload_weights`` from a
  folder, ``unirl_apply_delta`` of a delta version), ``/reset_prefix_cache``, ``/update_weight_version``,
  ``GET /weight_info``: full-weight publish;
- ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``: LoRA publish;
- ``POST /sleep`` / ``/wake_up``: colocated deployments (a no-op on the CPU backend).

Log-probs: the server runs with ``--logprobs-mode processed_logprobs``, i.e. ``log_softmax`` of
the logits after temperature (and after top-k/top-p, when set) -- the distribution the token was
drawn from, which is what the trainer replays when top_p=1 and top_k=0.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from unirl_core.errors import ConfigError, EngineError, field_error
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
from unirl_core.rollout.vllm.config import VLLMEngineConfig, default_python
from unirl_core.rollout.weights import is_checkpoint_ref, stage_weights
from unirl_core.types import ARSamplingParams, NoiseRecipe, SampleBatch

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "unirl_core.rollout.vllm.worker_ext.WeightSyncExtension"
_REPO_ROOT = str(Path(__file__).resolve().parents[3])


def server_argv(cfg: VLLMEngineConfig, python: str, port: int) -> list[str]:
    """Command line of the OpenAI-compatible vLLM server the engine starts."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model,
            "--served-model-name", cfg.served_model_name, "--host", cfg.host, "--port", str(port),
            "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len),
            "--logprobs-mode", "processed_logprobs", "--seed", str(cfg.seed), "--enable-scale-out",
            "--worker-extension-cls", WORKER_EXTENSION]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    if cfg.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.weight_sync == "lora":
        argv += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", "1"]
    return argv + list(cfg.extra_args)


def server_env(cfg: VLLMEngineConfig) -> dict[str, str]:
    env = dict(os.environ)
    # The worker imports WORKER_EXTENSION from this checkout; vLLM's venv does not install us.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    env.update({"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kv_cache_gib)})
    if cfg.weight_sync == "lora":
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.update(cfg.env)
    return env


def sampling_body(sp: ARSamplingParams, seed: int | None, *, ignore_eos: bool = False) -> dict:
    """vLLM ``SamplingParams`` fields of one request; ``logprobs=0`` returns the sampled token's only."""
    body = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "max_tokens": sp.max_new_tokens,
            "logprobs": 0, "detokenize": bool(sp.stop)}
    if ignore_eos:
        body["ignore_eos"] = True
    if sp.stop:
        body["stop"] = list(sp.stop)
    if seed is not None:
        body["seed"] = seed
    return body


def parse_completion(resp: object, where: str) -> Completion:
    """One ``/inference/v1/generate`` response (output_mode=tokens) -> ``Completion``."""
    try:
        choice = resp["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        content = (choice.get("logprobs") or {}).get("content") or []
        logps = [float(c["logprob"]) for c in content]
        spans = choice.get("weight_versions") or []
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise field_error(EngineError, where, str(resp)[:300], "a generate response with token_ids and logprobs",
                          f"check the server version and flags ({e!r})") from None
    if [int(c.get("token_id", t)) for c, t in zip(content, ids)] != ids:
        raise field_error(EngineError, f"{where}.logprobs", "token ids differ", "log-probs of the sampled tokens",
                          "request logprobs=0")
    versions = {str(s["version"]) for s in spans}
    if len(versions) != 1:
        raise field_error(EngineError, f"{where}.weight_versions", sorted(versions), "exactly one weight version",
                          "a completion mixing weights cannot be trained on; publish only between generate() calls")
    label = versions.pop()
    if not label.lstrip("-").isdigit():
        raise field_error(EngineError, f"{where}.weight_versions", label, "an integer policy version",
                          "let the engine label the server (update_weight_version) before generating")
    return Completion(response_ids=ids, log_probs=logps, policy_version=int(label),
                      finish_reason=to_finish_reason(choice.get("finish_reason"), f"{where}.finish_reason"))


@dataclass(frozen=True)
class _Publish:
    """One full-weight publish: the digest the worker keeps the version's host copy under (None: no copy) and the
    ``unirl_apply_delta`` arguments when the version is sent as a delta."""

    keep_sha256: str | None = None
    delta: dict | None = None


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())


def beside(background, foreground, *, name: str):
    """Run ``background()`` on a thread while ``foreground()`` runs on this one (two ranks of one collective that
    both block until the other arrives); returns (background's result, foreground's). A foreground error is
    raised first (after the thread ended); then a background one."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = background()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        result = foreground()
    finally:
        thread.join()
    if "error" in box:
        raise box["error"]
    return box["out"], result


class VLLMEngine:
    """``RolloutEngine`` over a vLLM server; fills AR Parts and stamps the version the server reports."""

    def __init__(self, config: VLLMEngineConfig, *, policy_version: int = 0, tokenizer=None) -> None:
        from unirl_core.models.tokenizer import load_tokenizer

        if config.model is None:
            raise field_error(ConfigError, "vllm.model", None, "a model directory or hub id to start from",
                              "pass save_pretrained(dir)'s dir; only the training loop fills it in itself")
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer or config.model)
        self.eos_ids = eos_token_ids(self.tokenizer, config.model if os.path.isdir(config.model) else None)
        self._lock = threading.Lock()  # generate and publish never overlap on one engine
        self._lora_name: str | None = None
        self._staging = Path(config.staging_dir or tempfile.mkdtemp(prefix="unirl-vllm-weights-"))
        self.server: ManagedServer | None = None
        self.last_sync_s: float | None = None
        """Wall seconds of the last ``update_weights`` (publish -> served)."""
        self.last_sync: dict[str, object] = {}
        """How the last ``update_weights`` reached the server: ``kind`` (``delta``, ``full`` or ``adapter``) and
        ``bytes`` (the delta file's size, or the staged folder's)."""
        self._held_sha256: str | None = None  # digest of the version the worker keeps a host copy of
        self._sent_deltas = False  # a delta version was published: keep each version's copy from then on
        self.client, self.server = connect_server(
            config, name="vllm", health_path="/health", argv=lambda py, port: server_argv(config, py, port),
            env=server_env(config), default_python=default_python)
        self.policy_version = int(policy_version)
        try:
            self._label(self.policy_version)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ RolloutEngine
    def generate(self, batch: SampleBatch, *, noise: NoiseRecipe | None = None) -> SampleBatch:
        """Sample every AR Part; ``noise`` is unused (AR randomness comes from per-request seeds)."""
        parts = ar_parts(batch)
        cache: dict[str, Tensor] = {}
        prompts = []
        for p in parts:  # siblings share a prompt: encode it once
            if p.prompt not in cache:
                cache[p.prompt] = encode_prompt(self.tokenizer, p.prompt, self.config.prompt)
            prompts.append(cache[p.prompt])
        tag = uuid.uuid4().hex[:8]
        bodies = []
        for i, (p, ids) in enumerate(zip(parts, prompts)):
            sp = p.sampling or ARSamplingParams()
            if ids.numel() + sp.max_new_tokens > self.config.max_model_len:
                raise field_error(EngineError, f"batch[{i}] prompt + max_new_tokens", ids.numel() + sp.max_new_tokens,
                                  f"<= max_model_len={self.config.max_model_len}",
                                  "shorten the prompt, lower max_new_tokens or raise vllm.max_model_len")
            bodies.append({"token_ids": ids.tolist(), "model": self._lora_name or self.config.served_model_name,
                           "output_mode": "tokens", "request_id": f"{p.sample_id}@v{self.policy_version}-{tag}",
                           "sampling_params": sampling_body(sp, request_seed(sp, p.sample_id),
                                                            ignore_eos=self.config.ignore_eos)})
        done = run_requests(self._lock, self.server, lambda: self._post_all(bodies))
        return collect(batch, prompts, done, policy_version=self.policy_version, tokenizer=self.tokenizer,
                       eos_ids=self.eos_ids)

    @property
    def request_model(self) -> str:
        """The ``model`` field of a generate request: the served adapter (LoRA sync) or the served model."""
        return self._lora_name or self.config.served_model_name

    def post_generate(self, bodies: Sequence[dict]) -> list[Completion]:
        """Send prepared ``/inference/v1/generate`` bodies (token ids in) under the engine lock, so a publish never
        overlaps them; completions in request order (the agentic engine's turns, ``rollout/agent_turns.py``)."""
        return run_requests(self._lock, self.server, lambda: self._post_all(bodies))

    def _post_all(self, bodies: Sequence[dict]) -> list[Completion]:
        def one(i: int, body: dict) -> Completion:
            return parse_completion(self.client.post("/inference/v1/generate", body), f"vllm.generate[{i}]")

        return post_all(one, bodies, max_concurrency=self.config.max_concurrency, name="vllm")

    # ------------------------------------------------------------------ weights
    def update_weights(self, path_or_ref: object, policy_version: int) -> float:
        """Serve the published weights as ``policy_version``; returns the wall seconds it took.

        ``path_or_ref``: a ``save_pretrained`` folder / peft adapter folder, or a ``CheckpointRef`` (its weights
        are checksum-verified and unpacked into the staging folder). A ref of a delta version
        (``checkpoint.weights_encoding: delta``) whose base the server holds is sent as the delta alone
        (``last_sync``: ``kind`` ``delta``, ``bytes`` its file's size); the worker checks the result against the
        version's digest, and anything else gets the version in full (``vllm/worker_ext.py``).
        """
        t0 = time.perf_counter()
        version = int(policy_version)
        if is_checkpoint_ref(path_or_ref) and int(path_or_ref.policy_version) != version:
            raise field_error(ConfigError, "policy_version", version, f"the ref's policy_version "
                              f"{path_or_ref.policy_version}", "publish a ref with the version it was saved under")

        def stage() -> Path:
            return stage_weights(path_or_ref, want="lora" if self.config.weight_sync == "lora" else "full",
                                 staging=self._staging, policy_version=version, lora_alpha=self.config.lora_alpha,
                                 base_model=self.config.model)

        if self.config.weight_sync == "lora":  # an adapter per version: nothing a delta could be applied to
            folder = stage()
            with self._lock:
                self._swap_adapter(folder, version)
                self.policy_version = version
            self.last_sync = {"kind": "adapter", "bytes": _folder_bytes(folder)}
        else:
            plan = self._plan(path_or_ref, version)
            folder = None if plan.delta is not None else stage()
            with self._lock:
                self._reload(folder or stage, version, plan)
                self.policy_version = version
        self.last_sync_s = time.perf_counter() - t0
        logger.info("vllm serves policy v%d (%s, %d bytes, %.2f s)", version, self.last_sync["kind"],
                    self.last_sync["bytes"], self.last_sync_s)
        return self.last_sync_s

    def expect_deltas(self) -> None:
        """The run writes delta versions (``checkpoint.weights_encoding: delta``): keep every version published from
        a ref as the next delta's base from the first one on, instead of from the first delta version."""
        self._sent_deltas = True

    def _plan(self, source: object, version: int) -> _Publish:
        """How version ``source`` reaches the server: a ref's digest (kept by the worker as the next delta's base
        once this engine has been sent a delta version: a run writing full versions never pays the host copy)
        and, for a delta version whose base the server holds, its verified file staged for the worker."""
        if not is_checkpoint_ref(source):
            return _Publish()
        from unirl_core.checkpoint.store import WEIGHTS, load_manifest, read_delta

        manifest = load_manifest(source)
        delta = manifest.delta
        self._sent_deltas = self._sent_deltas or delta is not None
        keep = manifest.weights_sha256(WEIGHTS) if self._sent_deltas else None
        if delta is None or self._held_sha256 is None or self._held_sha256 != delta["base_sha256"]:
            return _Publish(keep_sha256=keep)
        _, blob = read_delta(source)  # checked against the manifest's sha256
        path = self._staging / f"policy-v{version:08d}.xor.zst"
        self._staging.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
        return _Publish(keep_sha256=keep, delta={"delta_path": str(path), "size": int(delta["bytes"]),
                                                 "base_sha256": str(delta["base_sha256"]),
                                                 "sha256": str(delta["sha256"])})

    def _reload(self, folder, version: int, plan: _Publish) -> None:
        """Drain in-flight requests, bring the weights in place (the delta when ``plan`` has one and every worker
        applied it, else the full ``folder``, or ``folder()`` staged now), drop KV blocks computed with the old
        weights (a prefix-cache hit would otherwise mix versions), label, then resume."""
        self._held_sha256 = None
        self.client.post("/pause?mode=wait")
        try:
            results = self._all_workers("unirl_apply_delta", plan.delta) if plan.delta is not None else []
            if results and all(r.get("applied") for r in results):
                self.last_sync = {"kind": "delta", "bytes": int(results[0]["bytes_read"])}
            else:
                if results:
                    logger.info("vllm: delta of v%d not applied (%s); reloading it in full", version,
                                "; ".join(sorted({str(r.get("reason")) for r in results if not r.get("applied")})))
                folder = folder() if callable(folder) else folder
                self._all_workers("unirl_reload_weights", {"weights_path": str(folder),
                                                           "keep_sha256": plan.keep_sha256})
                self.last_sync = {"kind": "full", "bytes": _folder_bytes(folder)}
            self.client.post("/reset_prefix_cache")
            self._label(version)
            self._held_sha256 = plan.keep_sha256
        finally:
            self.client.post("/resume")
            if plan.delta is not None:
                Path(plan.delta["delta_path"]).unlink(missing_ok=True)

    def _all_workers(self, method: str, kwargs: dict) -> list[dict]:
        """``POST /collective_rpc`` of one of our worker-extension methods; every worker's result."""
        out = self.client.post("/collective_rpc", {"method": method, "kwargs": kwargs})
        results = (out or {}).get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise field_error(EngineError, f"vllm collective_rpc {method}", str(out)[:300], "a dict per worker",
                              "check that the server runs with the worker extension (server_argv)")
        return results

    def _swap_adapter(self, folder: Path, version: int) -> None:
        name = f"policy-v{version}"
        # These two endpoints answer 200 with a plain-text sentence.
        self.client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, expect_json=False)
        old, self._lora_name = self._lora_name, name
        self._label(version)
        if old is not None and old != name:
            self.client.post("/v1/unload_lora_adapter", {"lora_name": old}, expect_json=False)

    # ------------------------------------------------------------------ the trainer's broadcast (pool.publish: collective)
    def _rpc(self, method: str, kwargs: dict, timeout_s: float) -> dict:
        """``POST /collective_rpc`` of one of our worker-extension methods; the single worker's result."""
        out = self.client.post("/collective_rpc", {"method": method, "kwargs": kwargs}, timeout_s=timeout_s)
        results = (out or {}).get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or len(results) != 1 or not isinstance(results[0], dict):
            raise field_error(EngineError, f"vllm collective_rpc {method}", results, "one worker's dict result",
                              "run the server with one worker (no tensor / pipeline parallelism) for the "
                              "trainer's broadcast, or publish through the object store")
        return results[0]

    def join_sync(self, *, master_addr: str, master_port: int, rank: int, num_engines: int, timeout_s: float,
                  bucket_mb: float) -> dict:
        """The server's worker joins the trainer's publish group as ``rank``; blocks until the group is complete
        (call it on a thread while the other ranks join)."""
        kwargs = dict(master_addr=master_addr, master_port=int(master_port), rank=int(rank),
                      num_engines=int(num_engines), timeout_s=float(timeout_s), bucket_mb=float(bucket_mb))
        return self._rpc("unirl_join_sync", kwargs, timeout_s + 30.0)

    def receive_sync(self, policy_version: int, *, alongside, timeout_s: float):
        """Serve the version the trainer broadcasts now as ``policy_version``: drain requests, let the worker take
        the broadcast into the served model (on a thread, while ``alongside()`` runs on this one: the caller's
        own rank of the same broadcast), drop the prefix cache, label, resume. Returns ``alongside()``'s result;
        raises when either side failed (the version is not served then)."""
        t0 = time.perf_counter()
        version = int(policy_version)
        with self._lock:
            self._held_sha256 = None  # the worker drops its kept base on a broadcast
            self.client.post("/pause?mode=wait")
            try:
                out, result = beside(lambda: self._rpc("unirl_receive_sync", {}, timeout_s + 30.0), alongside,
                                     name="vllm-receive-sync")
                got = out.get("version")
                if got != version:
                    raise field_error(EngineError, "vllm unirl_receive_sync version", got, str(version),
                                      "the trainer broadcast another version; reload it from the store")
                self.client.post("/reset_prefix_cache")
                self._label(version)
                self.policy_version = version
            finally:
                self.client.post("/resume")
        self.last_sync_s = time.perf_counter() - t0
        logger.info("vllm serves policy v%d from the trainer's broadcast (%.2f s)", version, self.last_sync_s)
        return result

    def close_sync(self) -> None:
        """The worker leaves the publish group (best effort: a dead group or server is not an error here)."""
        try:
            self._rpc("unirl_close_sync", {}, 30.0)
        except EngineError as e:
            logger.warning("vllm: leaving the publish group: %s", e)

    def _label(self, version: int) -> None:
        self.client.post("/update_weight_version", {"new_version": str(version)})

    def served_version(self) -> int:
        """The weight version label the server reports now (``GET /weight_info``)."""
        info = self.client.get("/weight_info")
        return int(info["weight_version"])

    # ------------------------------------------------------------------ colocate
    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory for training (level 1 keeps weights in host memory, 2 drops them)."""
        if level not in (1, 2):
            raise field_error(EngineError, "sleep.level", level, "1 or 2", "use 1 unless weights are reloaded after")
        self.client.post(f"/sleep?level={level}")

    def wake_up(self) -> None:
        self.client.post("/wake_up")

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the server this engine started (an attached server is left running)."""
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
