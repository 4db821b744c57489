"""Trainside autoregressive engine: the training module itself samples completions.

Sampling runs a KV-cached decode loop (one prefill, then one single-token forward per step; no
logits processors, stopping criteria objects or per-step host work beyond one ``all finished``
check). Incremental decoding does NOT give the same bits as a full-sequence forward: the
attention and matmul reductions run over other shapes, so decode-time log-probs differ from a
replay by ~1e-7 (fp32) to ~1e-2 (bf16). The engine therefore records log-probs with a second,
full forward of the finished sequences (``logp_source='rescore'``) through
``unirl_core.models.lm.replay_log_probs`` over the micro-batches of
``unirl_core.models.micro_batch.plan_micro_batches``: consecutive ``forward_batch_size`` slices in batch
order, or token-budget packs with ``micro_batch_tokens`` - exactly the micro-batches and padding a trainer
with ``micro_batch_size == forward_batch_size`` (or the same ``micro_batch_tokens``) replays. The first
update's ratio is then exactly 1. Cost: one extra no-grad forward over ``B x (P + R)`` tokens (about one
prefill). Decoding batches rows by ``decode_batch_size`` (default ``forward_batch_size``): its numerics never
reach the recorded log-probs, so it may be as wide as memory allows.

Recorded log-probs are of ``softmax(logits / temperature)`` over the full vocabulary, i.e. before
top-k / top-p truncation; the trainer replays the same distribution, so ratio 1 holds with any
top-k/top-p. Truncated sampling is then slightly off-policy w.r.t. the recorded distribution
(tokens outside the nucleus are never drawn); keep top_p=1, top_k=0 for strict on-policy GRPO.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from unirl_core.errors import ConfigError, EngineError, check_ints, field_error
from unirl_core.models.lm import LMBundle, build_layout, replay_log_probs
from unirl_core.models.precision import module_dtype
from unirl_core.models.micro_batch import check_max_tokens, plan_micro_batches, token_lengths
from unirl_core.models.text import decode_completions
from unirl_core.rollout.ar_decoder import SUPPORTED_MODEL_TYPES, LeanDecoder, lean_decoder_supported
from unirl_core.types import ARSamplingParams, NoiseRecipe, Sample, SampleBatch, TokenSegment

logger = logging.getLogger(__name__)

DECODE_KV_FRACTION = 0.4
"""``decode_batch_size: None`` on a GPU: the share of the device memory not yet allocated that the decode's KV
cache may take (the rest is left to the prefill's activations, the logits and the caching allocator)."""

LogpSource = Literal["rescore", "decode"]
DecoderKind = Literal["auto", "lean", "transformers"]


@dataclass(frozen=True, kw_only=True)
class AREngineConfig:
    """How the trainside AR engine batches, templates and records log-probs."""

    forward_batch_size: int = 16
    """Rows per rescoring micro-batch (and per decode batch unless ``decode_batch_size`` is set); set it to the
    trainer's micro_batch_size."""
    decode_batch_size: int | None = None
    """Rows per KV-cached decode batch. None (default): on a GPU, as many rows as a KV cache of ``rows x (prompt +
    max_new_tokens)`` fits in ``DECODE_KV_FRACTION`` of the device memory not yet allocated (a multiple of
    ``forward_batch_size``; the width used is the metric ``rollout/decode_width``); on a CPU ``forward_batch_size``.
    Wider is faster for long completions (one decode step per token for the whole batch); recorded log-probs still
    come from the rescoring micro-batches, so exactness does not depend on it. Changing it changes which random
    draws a row gets (per-chunk seeds), not the sampling distribution: set it to pin the draws across machines."""
    micro_batch_tokens: int | None = None
    """Rescore over token-budget packs (``unirl_core.models.micro_batch``) instead of ``forward_batch_size``
    slices; must equal the trainer's ``train.micro_batch_tokens`` (the loop passes that value, leave it unset
    in a run config)."""
    apply_chat_template: bool | None = None
    """Wrap each prompt as one user message of the tokenizer's chat template; None = when it has one."""
    system_prompt: str | None = None
    """Optional system message placed before the user prompt (chat template only)."""
    logp_source: LogpSource = "rescore"
    """``rescore``: full forward of finished sequences in the trainer's layout (bit-exact replay);
    ``decode``: the decode loop's own log-probs (free, not bit-exact)."""
    stop_check_interval: int = 4
    """Decode steps between stop-string checks (each check decodes unfinished rows on the host)."""
    finish_check_interval: int = 4
    """Decode steps between "all rows finished?" checks (each is a host-device sync); finished rows emit padding."""
    seed: int = 0
    """Seed of the engine generator used when a Part's ``sampling.seed`` is None."""
    decoder: DecoderKind = "auto"
    """``lean`` (static-cache decoder over the model's submodules, Llama-family only), ``transformers``
    (the model's own forward with a DynamicCache), or ``auto`` (lean where supported)."""
    ignore_eos: bool = False
    """Keep sampling past EOS until ``max_new_tokens`` (throughput benchmarks); EOS then never ends a row."""
    cuda_graphs: bool | None = None
    """Lean decoder only: give its single-token step fixed shapes (attention over the whole KV cache under a mask)
    and, on a GPU, replay it as one CUDA graph per token instead of ~20 kernel launches per layer (the decode of a
    small model is launch-bound). Sampling logits differ from the dynamic step's only in float rounding; recorded
    log-probs still come from the rescoring forward, so exactness does not depend on it. None (default): on when
    the model is on a GPU and the lean decoder applies, else off (one log line says why); True: required (refused
    where the lean decoder does not apply; on a CPU the static step runs eagerly, no graph); False: off."""

    def __post_init__(self) -> None:
        check_ints("engine", self, ("forward_batch_size", "stop_check_interval", "finish_check_interval"),
                   "use e.g. 16")
        if self.decode_batch_size is not None and not (isinstance(self.decode_batch_size, int)
                                                       and not isinstance(self.decode_batch_size, bool)
                                                       and self.decode_batch_size >= 1):
            raise field_error(ConfigError, "engine.decode_batch_size", self.decode_batch_size,
                              "None or an integer >= 1", "use e.g. 64, or None to decode in forward_batch_size rows")
        check_max_tokens(self.micro_batch_tokens, "engine.micro_batch_tokens")
        if self.decoder not in ("auto", "lean", "transformers"):
            raise field_error(ConfigError, "engine.decoder", self.decoder, "'auto', 'lean' or 'transformers'",
                              "use 'auto'")
        if self.cuda_graphs is True and self.decoder == "transformers":
            raise field_error(ConfigError, "engine.cuda_graphs", True, "decoder 'auto' or 'lean' (the graph replays "
                              "the lean decoder's step)", "set engine.decoder=auto, or engine.cuda_graphs=false")
        if self.logp_source not in ("rescore", "decode"):
            raise field_error(ConfigError, "engine.logp_source", self.logp_source, "'rescore' or 'decode'",
                              "use 'rescore' for exact replay")


@dataclass
class _Decoded:
    response_ids: list[Tensor]
    log_probs: list[Tensor]
    finish: list[str]


def sample_next(logits: Tensor, sp: ARSamplingParams, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Sample one token per row from ``logits [B, V]``; returns ids ``[B]`` and their recorded log-probs ``[B]``."""
    scaled = logits.float() / sp.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    filt = scaled
    if sp.top_k and sp.top_k < filt.shape[-1]:
        kth = torch.topk(filt, sp.top_k, dim=-1).values[:, -1:]
        filt = filt.masked_fill(filt < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(filt, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filt = filt.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filt, dim=-1) if filt is not scaled else logp.exp()
    # Inverse-CDF draw: one uniform per row (several times cheaper than multinomial on CPU). A token
    # of probability 0 spans an empty interval of the cumsum, so it is never drawn.
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


class TrainsideAREngine:
    """``RolloutEngine`` over an ``LMBundle``: fills each AR Part's TokenSegment, text and policy version."""

    def __init__(self, bundle: LMBundle, config: AREngineConfig | None = None, *, policy_version: int = 0) -> None:
        self.bundle = bundle
        self.config = config or AREngineConfig()
        self.policy_version = policy_version
        self._generator = torch.Generator(device=self._device).manual_seed(self.config.seed)
        self.last_decode_rescore_absdiff: float | None = None
        """Max |decode - rescore| log-prob of the last generate() (rescore mode): the KV-cache drift."""
        self.last_decode_width: int | None = None
        """Rows per decode batch of the last decode (``decode_width``)."""
        self._said_graphs = False

    @property
    def _device(self) -> torch.device:
        return next(self.bundle.module.parameters()).device

    # ------------------------------------------------------------------ prompts
    def _use_template(self) -> bool:
        want = self.config.apply_chat_template
        has = bool(getattr(self.bundle.tokenizer, "chat_template", None))
        if want and not has:
            raise field_error(ConfigError, "engine.apply_chat_template", True, "a tokenizer with a chat template",
                              "set apply_chat_template=False or use a tokenizer that has one")
        return has if want is None else want

    def encode_prompt(self, prompt: str) -> Tensor:
        """Prompt token ids ``[P]`` int64, after the chat template when it applies."""
        tok = self.bundle.tokenizer
        text = prompt
        if self._use_template():
            msgs = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
            msgs.append({"role": "user", "content": prompt})
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=not self._use_template())["input_ids"]
        if not ids:
            raise field_error(EngineError, "part.prompt", prompt, "a prompt that encodes to >= 1 token",
                              "give every Part a non-empty prompt or enable the chat template")
        return torch.tensor(ids, dtype=torch.int64)

    # ------------------------------------------------------------------ generate
    def generate(self, batch: SampleBatch, *, noise: NoiseRecipe | None = None) -> SampleBatch:
        """Sample every AR Part of ``batch``; ``noise`` is unused (AR randomness comes from the seeds)."""
        parts = batch.generated
        for i, p in enumerate(parts):
            if p.kind != "ar":
                raise field_error(EngineError, f"batch[{i}].generated.kind", p.kind, "'ar'",
                                  "route diffusion Parts to a diffusion engine")
        sps = [p.sampling or ARSamplingParams() for p in parts]
        encoded: dict[str, Tensor] = {}  # siblings share a prompt: encode each text once
        for p in parts:
            if p.prompt not in encoded:
                encoded[p.prompt] = self.encode_prompt(p.prompt)
        prompts = [encoded[p.prompt] for p in parts]
        decoded: list[tuple[Tensor, Tensor, str] | None] = [None] * len(parts)
        module = self.bundle.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self.bundle.compute():
                for sp, rows in _group_by_params(sps).items():
                    width = self.decode_width(len(rows), max(int(prompts[i].numel()) for i in rows), sp.max_new_tokens)
                    for k in range(0, len(rows), width):
                        chunk = rows[k:k + width]
                        gen = self._generator_for(sp, k // width)
                        out = self._decode([prompts[i] for i in chunk], sp, gen)
                        for j, i in enumerate(chunk):
                            decoded[i] = (out.response_ids[j], out.log_probs[j], out.finish[j])
                segments = [TokenSegment(prompt_ids=prompts[i], response_ids=d[0], log_probs=d[1],
                                         response_mask=torch.ones_like(d[0], dtype=torch.bool), finish_reason=d[2])
                            for i, d in enumerate(decoded)]
                if self.config.logp_source == "rescore":
                    self._rescore(segments, sps)
        finally:
            module.train(was_training)
        return self._fill(batch, segments)

    def decode_ids(self, prompts: Sequence[Tensor], sp: ARSamplingParams,
                   generator: torch.Generator | None = None) -> list[tuple[Tensor, Tensor, str]]:
        """Continue token-id contexts ``[P_i]`` (no template, no rescoring): per row the sampled ids ``[R]``,
        their decode-time log-probs ``[R]`` and finish reason (``stop`` / ``length``). Rows are decoded in
        batches of the decode width; multi-turn engines (``unirl_core.rollout.agentic``) call it once per turn."""
        width = self.decode_width(len(prompts), max((int(x.numel()) for x in prompts), default=1), sp.max_new_tokens)
        gen = generator or self._generator
        module, out = self.bundle.module, []
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self.bundle.compute():
                for k in range(0, len(prompts), width):
                    d = self._decode(list(prompts[k:k + width]), sp, gen)
                    out += list(zip(d.response_ids, d.log_probs, d.finish))
        finally:
            module.train(was_training)
        return out

    def rescore(self, segments: list[TokenSegment], sps: Sequence[ARSamplingParams]) -> None:
        """Set every segment's ``log_probs`` to the trainer's replay over its micro-batch plan (in place)."""
        module = self.bundle.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self.bundle.compute():
                self._rescore(segments, sps)
        finally:
            module.train(was_training)

    def _use_lean(self, model) -> bool:
        mode = self.config.decoder
        if mode == "transformers":
            return False
        ok = lean_decoder_supported(model) and getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager")
        if mode == "lean" and not ok:
            raise field_error(ConfigError, "engine.decoder", mode, f"a model of type {SUPPORTED_MODEL_TYPES}",
                              "use decoder='auto' or 'transformers'")
        if self.config.cuda_graphs is True and not ok:
            raise field_error(ConfigError, "engine.cuda_graphs", True, "the lean decoder (decoder 'auto' or 'lean' "
                              f"on a model of type {SUPPORTED_MODEL_TYPES}, sdpa or eager attention)",
                              "set engine.cuda_graphs=false for this model")
        return ok

    def _graphs(self) -> bool:
        """Whether the lean decoder's step replays as a CUDA graph (``cuda_graphs``; None: on a GPU)."""
        want = self.config.cuda_graphs
        if want is None:
            want = self._device.type == "cuda"
            if not want and not self._said_graphs:
                self._said_graphs = True
                logger.info("engine.cuda_graphs=auto: the decode step runs eager (the model is on %s)", self._device)
        return bool(want)

    def decode_width(self, rows: int, prompt_len: int, max_new_tokens: int) -> int:
        """Rows per decode batch for ``rows`` requests (``decode_batch_size``; None: sized from device memory on a
        GPU, ``forward_batch_size`` on a CPU); remembered as ``last_decode_width``."""
        fixed = self.config.decode_batch_size
        fbs = self.config.forward_batch_size
        if fixed is not None or self._device.type != "cuda":
            width = fixed or fbs
        else:
            cfg = self.bundle.module.config
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            itemsize = torch.empty((), dtype=module_dtype(self.bundle.module)).element_size()
            per_row = 2 * cfg.num_hidden_layers * kv_heads * head_dim * (prompt_len + max_new_tokens) * itemsize
            total = torch.cuda.get_device_properties(self._device).total_memory
            budget = DECODE_KV_FRACTION * (total - torch.cuda.memory_allocated(self._device))
            fits = int(budget // max(per_row, 1)) // fbs * fbs
            width = max(fbs, min(fits, -(-rows // fbs) * fbs))
        self.last_decode_width = min(width, rows)
        return width

    def _generator_for(self, sp: ARSamplingParams, chunk_index: int) -> torch.Generator:
        if sp.seed is None:
            return self._generator
        return torch.Generator(device=self._device).manual_seed(sp.seed * 1_000_003 + chunk_index)

    def _rescore(self, segments: list[TokenSegment], sps: Sequence[ARSamplingParams]) -> None:
        """Replace decode-time log-probs by the replay forward over the trainer's micro-batches."""
        drift = 0.0
        plan = plan_micro_batches(token_lengths(segments, field="engine.micro_batch_tokens"),
                                  size=self.config.forward_batch_size, max_tokens=self.config.micro_batch_tokens)
        for idx in plan:
            seg = [segments[i] for i in idx]
            layout = build_layout(seg, [sps[i].temperature for i in idx], pad_id=self.bundle.pad_token_id,
                                  device=self._device)
            logp, _ = replay_log_probs(self.bundle.module, layout, chunk_tokens=self.bundle.logprob_chunk_tokens)
            logp = logp.cpu()
            for j, s in enumerate(seg):
                new = logp[j, :s.num_response_tokens].contiguous()
                drift = max(drift, float((new - s.log_probs).abs().max()))
                s.log_probs = new
        self.last_decode_rescore_absdiff = drift

    def _fill(self, batch: SampleBatch, segments: list[TokenSegment]) -> SampleBatch:
        texts = decode_completions(self.bundle.tokenizer, [seg.response_ids.tolist() for seg in segments],
                                   skip_ids=self.bundle.eos_token_ids)
        samples = []
        for s, seg, text in zip(batch.samples, segments, texts):
            part = s.generated.copy(segment=seg, text=text, policy_version=self.policy_version)
            parts = [part if p is s.generated else p.copy() for p in s.parts]
            samples.append(Sample(sample_id=s.sample_id, group_id=s.group_id, parts=parts))
        return SampleBatch(samples=samples, metadata=dict(batch.metadata))

    # ------------------------------------------------------------------ decode loop
    def _decode(self, prompts: list[Tensor], sp: ARSamplingParams, gen: torch.Generator) -> _Decoded:
        model, dev = self.bundle.module, self._device
        pad = self.bundle.pad_token_id
        eos = torch.tensor([] if self.config.ignore_eos else self.bundle.eos_token_ids, dtype=torch.int64, device=dev)
        b, p, n = len(prompts), max(int(x.numel()) for x in prompts), sp.max_new_tokens
        ids = torch.full((b, p), pad, dtype=torch.int64)
        mask = torch.zeros((b, p), dtype=torch.int64)
        for i, x in enumerate(prompts):
            ids[i, p - x.numel():] = x
            mask[i, p - x.numel():] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        lean = None
        if self._use_lean(model):
            lean = LeanDecoder(model, batch=b, max_len=p + n, graphs=self._graphs())
            logits, step = lean.prefill(ids, mask), lean.step
        else:
            logits, step = _transformers_stepper(model, ids, mask, n)
        tokens = torch.full((b, n), pad, dtype=torch.int64, device=dev)
        logps = torch.zeros((b, n), dtype=torch.float32, device=dev)
        lengths = torch.full((b,), n, dtype=torch.int64, device=dev)
        finished = torch.zeros(b, dtype=torch.bool, device=dev)
        steps = 0
        try:
            for t in range(n):
                tok, lp = sample_next(logits, sp, gen)
                tok = tok.masked_fill(finished, pad)
                tokens[:, t], logps[:, t] = tok, lp
                hit = torch.isin(tok, eos) & ~finished
                lengths = torch.where(hit, t + 1, lengths)
                finished |= hit
                steps = t + 1
                if sp.stop and (steps % self.config.stop_check_interval == 0 or steps == n):
                    self._check_stops(tokens, steps, sp.stop, finished, lengths)
                # Checking for "all finished" syncs with the device; every few steps keeps the GPU queue full.
                if steps == n or (steps % self.config.finish_check_interval == 0 and bool(finished.all())):
                    break
                logits = step(tok)
            lengths = lengths.clamp(max=steps).cpu()
            finished = finished.cpu()
            tokens, logps = tokens.cpu(), logps.cpu()
        finally:
            if lean is not None:
                lean.close()  # the static cache and, after a CUDA graph, the graph and cuBLAS workspaces
        finish = ["stop" if bool(finished[i]) else "length" for i in range(b)]
        return _Decoded(response_ids=[tokens[i, :int(lengths[i])].clone() for i in range(b)],
                        log_probs=[logps[i, :int(lengths[i])].clone() for i in range(b)], finish=finish)

    def _check_stops(self, tokens: Tensor, steps: int, stop: tuple[str, ...], finished: Tensor,
                     lengths: Tensor) -> None:
        """Mark rows whose text contains a stop string; the response ends at the token completing it."""
        tok = self.bundle.tokenizer
        rows = torch.nonzero(~finished).flatten().tolist()
        host = tokens[:, :steps].cpu()
        for i in rows:
            text = tok.decode(host[i].tolist(), skip_special_tokens=True)
            if not any(s in text for s in stop):
                continue
            cut = next(k for k in range(1, steps + 1)
                       if any(s in tok.decode(host[i, :k].tolist(), skip_special_tokens=True) for s in stop))
            lengths[i] = cut
            finished[i] = True


def _transformers_stepper(model, ids: Tensor, mask: Tensor, n: int):
    """Prefill through the model's own forward; returns first logits ``[B, V]`` and a ``step(tokens)`` closure."""
    b, p = ids.shape
    full = torch.cat([mask, torch.ones((b, n), dtype=mask.dtype, device=mask.device)], dim=1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    state = {"cache": out.past_key_values, "pos": pos[:, -1:] + 1, "len": p}
    step_mask = _decode_mask(full, getattr(model.config, "_attn_implementation", None), out.logits.dtype)

    def step(tok: Tensor) -> Tensor:
        state["len"] += 1
        o = model(input_ids=tok[:, None], attention_mask=step_mask(state["len"]), position_ids=state["pos"],
                  past_key_values=state["cache"], use_cache=True)
        state["cache"], state["pos"] = o.past_key_values, state["pos"] + 1
        return o.logits[:, -1]

    return out.logits[:, -1], step


def _decode_mask(mask: Tensor, attn: str | None, dtype: torch.dtype):
    """Per-step attention mask builder for single-token decode steps.

    transformers rebuilds a 4-D mask from the 2-D one on every forward (a noticeable share of a
    small model's step time). A single query attends to every earlier key, so only padding needs
    masking: without padding no mask is passed at all; with padding a 4-D mask is prepared once
    and sliced (bool for SDPA, additive for eager). Decode-time numerics need not match the
    trainer's, since recorded log-probs come from the rescoring forward.
    """
    if bool(mask.all()):
        return lambda length: None
    if attn == "sdpa":
        full = mask.bool()[:, None, None, :]
    elif attn == "eager":
        full = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask == 0, torch.finfo(dtype).min)
        full = full[:, None, None, :]
    else:
        return lambda length: mask[:, :length]
    return lambda length: full[..., :length]


def _group_by_params(sps: Sequence[ARSamplingParams]) -> dict[ARSamplingParams, list[int]]:
    groups: dict[ARSamplingParams, list[int]] = {}
    for i, sp in enumerate(sps):
        groups.setdefault(sp, []).append(i)
    return groups
