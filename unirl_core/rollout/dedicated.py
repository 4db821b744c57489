"""What every dedicated AR engine (vLLM, SGLang) shares: prompt encoding, seeds, filling Samples.

Dedicated engines are token-in / token-out: the prompt is tokenised HERE, with the trainer's
tokenizer and chat-template rule (the same rule as the trainside engine), and those exact ids are
sent to the server. So ``TokenSegment.prompt_ids`` is what the server conditioned on and what the
trainer replays; no server-side template or tokenizer can shift a token.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, EngineError, field_error
from unirl_core.models.text import decode_completion
from unirl_core.rollout.server import HTTPJSONClient, ManagedServer, reserve_port
from unirl_core.types import ARSamplingParams, FinishReason, Part, Sample, SampleBatch, TokenSegment


@dataclass(frozen=True, kw_only=True)
class PromptFormat:
    """How a Part's prompt text becomes token ids (mirror of the trainside engine's rule)."""

    apply_chat_template: bool | None = None
    """Wrap the prompt as one user message of the tokenizer's chat template; None = when it has one."""
    system_prompt: str | None = None
    """Optional system message before the user prompt (chat template only)."""


def encode_prompt(tokenizer, prompt: str, fmt: PromptFormat) -> Tensor:
    """Prompt ids ``[P]`` int64, after the chat template when it applies."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if fmt.apply_chat_template and not has:
        raise field_error(ConfigError, "engine.prompt.apply_chat_template", True, "a tokenizer with a chat template",
                          "set apply_chat_template=False or use a tokenizer that has one")
    use = has if fmt.apply_chat_template is None else fmt.apply_chat_template
    text = prompt
    if use:
        msgs = [{"role": "system", "content": fmt.system_prompt}] if fmt.system_prompt else []
        msgs.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=not use)["input_ids"]
    if not ids:
        raise field_error(EngineError, "part.prompt", prompt, "a prompt that encodes to >= 1 token",
                          "give every Part a non-empty prompt or enable the chat template")
    return torch.tensor(ids, dtype=torch.int64)


def request_seed(sp: ARSamplingParams, sample_id: str) -> int | None:
    """Per-request seed: the Part's seed mixed with its sample id (stable hash), None when unseeded.

    Siblings share one ``ARSamplingParams`` (and so one seed); a server that seeds each request
    independently would then return G identical completions and a zero-variance group.
    """
    if sp.seed is None:
        return None
    digest = hashlib.sha256(f"{sp.seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def ar_parts(batch: SampleBatch) -> list[Part]:
    """The generated Parts of ``batch``, checked to be AR requests."""
    parts = batch.generated
    for i, p in enumerate(parts):
        if p.kind != "ar":
            raise field_error(EngineError, f"batch[{i}].generated.kind", p.kind, "'ar'",
                              "route diffusion Parts to a diffusion engine")
    return parts


@dataclass(kw_only=True)
class Completion:
    """One server completion, already in our types."""

    response_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    policy_version: int


def to_finish_reason(raw: object, where: str) -> FinishReason:
    """Map a server's finish reason (OpenAI/vLLM/SGLang spellings) to ours."""
    name = raw.get("type") if isinstance(raw, dict) else raw
    table = {"stop": "stop", "eos": "stop", "length": "length", "abort": "abort", "cancelled": "abort"}
    if name not in table:
        raise field_error(EngineError, where, raw, f"one of {sorted(table)}", "check the server version")
    return table[name]  # type: ignore[return-value]


def fill_batch(batch: SampleBatch, prompts: Sequence[Tensor], done: Sequence[Completion], tokenizer,
               eos_ids: Sequence[int]) -> SampleBatch:
    """A new batch whose generated Parts carry segment, text and the version that served them."""
    eos = set(eos_ids)
    samples = []
    for i, (s, prompt, c) in enumerate(zip(batch.samples, prompts, done)):
        if len(c.response_ids) != len(c.log_probs):
            raise field_error(EngineError, f"batch[{i}].log_probs", (len(c.response_ids), len(c.log_probs)),
                              "one log-prob per sampled token", "request logprobs=0 (the sampled token's)")
        ids = torch.tensor(c.response_ids, dtype=torch.int64)
        seg = TokenSegment(prompt_ids=prompt, response_ids=ids,
                           log_probs=torch.tensor(c.log_probs, dtype=torch.float32),
                           response_mask=torch.ones(len(c.response_ids), dtype=torch.bool),
                           finish_reason=c.finish_reason)
        text = decode_completion(tokenizer, c.response_ids, skip_ids=eos)
        part = s.generated.copy(segment=seg, text=text, policy_version=c.policy_version)
        parts = [part if p is s.generated else p.copy() for p in s.parts]
        samples.append(Sample(sample_id=s.sample_id, group_id=s.group_id, parts=parts))
    return SampleBatch(samples=samples, metadata=dict(batch.metadata))


def eos_token_ids(tokenizer, model_dir: str | None) -> tuple[int, ...]:
    """EOS ids the server stops on: the tokenizer's plus ``generation_config.json``'s (when readable)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    if model_dir:
        try:
            from transformers import GenerationConfig

            extra = GenerationConfig.from_pretrained(model_dir).eos_token_id
        except (OSError, ValueError):
            extra = None
        if extra is not None:
            ids.update([int(extra)] if isinstance(extra, int) else [int(e) for e in extra])
    return tuple(sorted(ids))


def post_all(post_one: Callable[[int, dict], Completion], bodies: Sequence[dict], *, max_concurrency: int,
             name: str) -> list[Completion]:
    """Send every request body concurrently (the server batches them); results in request order."""
    workers = max(1, min(max_concurrency, len(bodies)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-req") as pool:
        return list(pool.map(lambda i: post_one(i, bodies[i]), range(len(bodies))))


def run_requests(lock: threading.Lock, server, send: Callable[[], list[Completion]]) -> list[Completion]:
    """Run ``send`` under the engine lock; a server that died meanwhile raises with its log tail."""
    with lock:
        try:
            return send()
        except EngineError:
            if server is not None:
                server.raise_if_dead()
            raise


def collect(batch: SampleBatch, prompts: Sequence[Tensor], done: Sequence[Completion], *, policy_version: int,
            tokenizer, eos_ids: Sequence[int]) -> SampleBatch:
    """Check every completion came from ``policy_version``, then fill the batch."""
    stale = [(i, c.policy_version) for i, c in enumerate(done) if c.policy_version != policy_version]
    if stale:
        raise field_error(EngineError, "served policy_version", stale[:5], f"{policy_version} everywhere",
                          "another client updated this server; give each engine its own server or publisher")
    return fill_batch(batch, prompts, done, tokenizer, eos_ids)


def connect_server(config, *, name: str, health_path: str, argv: Callable[[str, int], list[str]],
                   env: dict[str, str], default_python: Callable[[], str]):
    """``(client, server)`` for a dedicated engine: attach to ``config.base_url`` (checked healthy; ``server``
    is None and is never stopped by us) or start our own server on a free port and wait for it."""
    if config.base_url is not None:
        client = HTTPJSONClient(config.base_url, timeout_s=config.request_timeout_s)
        if not client.is_healthy(health_path):
            raise field_error(EngineError, f"{name}.base_url", config.base_url, f"a healthy {name} server",
                              "start it first (see the rollout README) or leave base_url None")
        return client, None
    port = config.port or reserve_port(config.host)
    client = HTTPJSONClient(f"http://{config.host}:{port}", timeout_s=config.request_timeout_s)
    server = ManagedServer(argv(config.python or default_python(), port), env=env, name=name,
                           log_dir=config.log_dir)
    server.start(client, health_path=health_path, timeout_s=config.startup_timeout_s)
    return client, server
