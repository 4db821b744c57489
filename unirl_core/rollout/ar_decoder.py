"""A lean KV-cached decoder for Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3).

Why: a transformers forward call carries a fixed Python cost (mask construction, output
capturing, cache objects, rotary recomputation) that dominates a small model's decode step and
is still visible for a 0.6B model at batch 64. This decoder calls the model's own submodules
(norms, projections - LoRA-wrapped or not -, MLPs, LM head) in the standard pre-norm order, with a
preallocated static KV cache, rotary tables computed once per batch, and a mask prepared once.

It only produces *sampling* logits. Recorded log-probs still come from the engine's rescoring
forward through the model's regular ``forward`` (the one the trainer replays), so nothing here
has to be bit-identical to transformers; ``tests/unit/rollout/test_ar_decoder.py`` checks it
agrees to float tolerance. Architectures it does not recognise use the transformers path.

``static=True`` gives the single-token step fixed shapes and addresses: attention over the whole cache under a
mask that opens one column per step, the new K/V written at a device-side column index, positions in a device
tensor advanced in place. ``graphs=True`` (CUDA) then records that step once as a CUDA graph and replays it
for every further token: a 0.6B model's decode step is ~28 layers x ~20 kernel launches, launch-bound at batch
64 on an H200 (~13 ms a token measured), and a replay is one launch. The first step runs eagerly on a side
stream (warm-up: library handles, workspaces), the second is captured then replayed. On a CPU ``graphs`` is
ignored and the static step runs eagerly (what the unit tests check against the dynamic step).

Warm-up and capture run on one side stream per device, kept for the process, and ``close()`` (the engine calls it
after each decode batch) drops the graph, its static buffers and the cache and clears cuBLAS's workspaces: cuBLAS
keeps a workspace (32 MiB on an H200) per (handle, stream) in the caching allocator for the life of the process,
so a fresh warm-up stream per decode batch left one more workspace allocated after every rollout (+160 MiB at the
training step's peak after 4 rollouts, measured at the qwen3-math shape), and a workspace first used during
capture would outlive its graph. The clear runs on the main thread only (a lagged rollout's sampler thread
leaves its side stream's one workspace in place rather than clear those of a train step running beside it).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the stream graph warm-ups and captures run on


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def lean_decoder_supported(model: nn.Module) -> bool:
    """True for an unwrapped Llama-family CausalLM with full attention in every layer and SDPA-able masks."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return False
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return False
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    return all(hasattr(inner, a) for a in parts) and hasattr(model, "lm_head")


def _rms(norm: nn.Module, x: Tensor) -> Tensor:
    """The model's RMSNorm as one fused call (sampling logits only: need not match transformers' bits)."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
    if w is None or eps is None or type(norm).__name__ not in _PLAIN_RMS:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), weight=w, eps=eps)


_PLAIN_RMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


class LeanDecoder:
    """Prefill + single-token steps over a static cache; ``[B, V]`` logits of the last position each call.

    Layout: left-padded prompts ``[B, P]``; cache column ``P + t`` holds generated token t.
    """

    def __init__(self, model: nn.Module, *, batch: int, max_len: int, static: bool = False,
                 graphs: bool = False) -> None:
        self.model = model
        cfg = model.config
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        p = next(model.parameters())
        shape = (batch, self.n_kv, max_len, self.head_dim)
        self.graphs = graphs and p.device.type == "cuda"
        self.static = static or graphs  # on a CPU: the static step, run eagerly
        # static: attention reads every column, so unwritten ones must hold finite values (0 x NaN is NaN)
        alloc = torch.zeros if self.static else torch.empty
        self.k = [alloc(shape, dtype=p.dtype, device=p.device) for _ in self.layers]
        self.v = [alloc(shape, dtype=p.dtype, device=p.device) for _ in self.layers]
        self.max_len = max_len
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: Tensor | None = None
        self.closed = False
        self._steps = 0
        self._cos = self._sin = None
        self._key_mask: Tensor | None = None
        self._length = 0

    def prefill(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``input_ids``/``attention_mask`` ``[B, P]`` (left padded); returns the last position's logits."""
        self._check_open()
        b, p = input_ids.shape
        dev = input_ids.device
        pos_all = torch.arange(self.max_len, device=dev)[None]
        cos, sin = self.inner.rotary_emb(self.k[0], pos_all)  # [1, max_len, D] tables, model dtype
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi]: two ops fewer per rotation.
        half = self.head_dim // 2
        self._cos, self._sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        pad_offset = (attention_mask == 0).sum(-1, keepdim=True)
        self._pad = pad_offset  # [B, 1] leading pad count: position = column - pad
        key_ok = torch.ones((b, self.max_len), dtype=torch.bool, device=dev)
        key_ok[:, :p] = attention_mask.bool()
        self._key_mask = None if bool(key_ok.all()) else key_ok[:, None, None, :]
        causal = torch.ones((p, p), dtype=torch.bool, device=dev).tril()
        mask = causal[None, None] & key_ok[:, None, None, :p]
        # Pad query rows would attend to nothing (NaN in SDPA); let them see themselves instead.
        mask = mask | torch.eye(p, dtype=torch.bool, device=dev)[None, None]
        positions = (torch.arange(p, device=dev)[None] - pad_offset).clamp(min=0)
        self._length = 0
        logits = self._forward(input_ids, positions, mask, start=0)
        if self.static:  # the step's fixed buffers: its input ids, next column and positions, the open columns
            self._ids = torch.zeros((b, 1), dtype=torch.int64, device=dev)
            self._col = torch.full((1,), p, dtype=torch.int64, device=dev)
            self._pos = p - pad_offset  # [B, 1]
            open_cols = key_ok.clone()
            open_cols[:, p:] = False
            self._open = open_cols[:, None, None, :]  # [B, 1, 1, max_len]
        return logits

    def step(self, token_ids: Tensor) -> Tensor:
        """Feed one token per row (``[B]``); returns next-token logits ``[B, V]`` (static: a buffer the next
        step overwrites)."""
        self._check_open()
        if self.static:
            return self._replay(token_ids)
        start = self._length
        positions = start - self._pad
        mask = None if self._key_mask is None else self._key_mask[..., :start + 1]
        return self._forward(token_ids[:, None], positions, mask, start=start)

    def _forward(self, ids: Tensor, positions: Tensor, mask: Tensor | None, *, start: int) -> Tensor:
        b, q = ids.shape
        end = start + q
        if end > self.max_len:
            raise RuntimeError(f"lean decoder cache of {self.max_len} columns is full")  # internal invariant
        h = self.inner.embed_tokens(ids)
        cos = self._cos[positions][:, None]  # [B, 1, q, D]
        sin = self._sin[positions][:, None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            qs, ks, vs = self._qkv(attn, _rms(layer.input_layernorm, h), cos, sin)
            self.k[i][:, :, start:end] = ks
            self.v[i][:, :, start:end] = vs
            o = F.scaled_dot_product_attention(qs, self.k[i][:, :, :end], self.v[i][:, :, :end], attn_mask=mask,
                                               scale=attn.scaling, enable_gqa=self.n_kv != self.n_heads)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(b, q, self.n_heads * self.head_dim))
            h = h + layer.mlp(_rms(layer.post_attention_layernorm, h))
        self._length = end
        return self.model.lm_head(_rms(self.inner.norm, h[:, -1]))

    def _qkv(self, attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries ``[B, H, q, D]``, keys and values ``[B, KV, q, D]`` of the normed hidden ``x [B, q, C]``."""
        b, q = x.shape[:2]
        qs = attn.q_proj(x).view(b, q, self.n_heads, self.head_dim)
        ks = attn.k_proj(x).view(b, q, self.n_kv, self.head_dim)
        vs = attn.v_proj(x).view(b, q, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            qs, ks = _rms(attn.q_norm, qs), _rms(attn.k_norm, ks)
        qk = torch.cat((qs, ks), dim=2).transpose(1, 2)  # rotate q and k heads together
        qk = qk * cos + qk.roll(self.head_dim // 2, dims=-1) * sin
        return qk[:, :self.n_heads], qk[:, self.n_heads:], vs

    def _replay(self, token_ids: Tensor) -> Tensor:
        if self._length + self._steps >= self.max_len:
            raise RuntimeError(f"lean decoder cache of {self.max_len} columns is full")  # internal invariant
        self._ids.copy_(token_ids[:, None])
        self._steps += 1
        if not self.graphs:
            return self._static_step()
        side = _side_stream(self._ids.device)
        if self._steps == 1:  # warm-up, eagerly on a side stream (as CUDA graph capture requires)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self._static_step()
            torch.cuda.current_stream().wait_stream(side)
            return out
        if self._graph is None:
            self._graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls during the capture (the checkpoint writer waiting on its
            # staging event while this rollout runs) must not invalidate it
            with torch.cuda.graph(self._graph, stream=side, capture_error_mode="thread_local"):
                self._out = self._static_step()
        self._graph.replay()
        return self._out

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("lean decoder used after close()")  # internal invariant: one decoder per batch

    def close(self) -> None:
        """Free the cache, the step's buffers and the graph (and, after a graph, cuBLAS's per-stream workspaces).

        Idempotent; the decoder cannot step again after it."""
        graphed = self._graph is not None
        if graphed:
            torch.cuda.current_stream().synchronize()  # the last replay may still read the memory freed below
        self._graph = self._out = None
        self.k, self.v = [], []
        self._ids = self._col = self._pos = self._open = None
        self._cos = self._sin = self._key_mask = None
        self.closed = True
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        # the clear drops every thread's workspaces: only from the main thread, so a decoder on a lagged rollout's
        # sampler thread never pulls one from under a train step running beside it (that side stream's one
        # workspace then stays allocated: it is reused by every later warm-up on the same stream)
        if graphed and clear is not None and threading.current_thread() is threading.main_thread():
            clear()  # re-created on the next cuBLAS call of each stream that makes one

    def _static_step(self) -> Tensor:
        """One token per row at fixed shapes: no host sync, no shape that depends on the step (graph-safe)."""
        col, b = self._col, self._ids.shape[0]
        self._open.index_fill_(-1, col, True)  # the new token's column; generated columns attend for every row
        h = self.inner.embed_tokens(self._ids)
        cos = self._cos[self._pos][:, None]  # [B, 1, 1, D]
        sin = self._sin[self._pos][:, None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            qs, ks, vs = self._qkv(attn, _rms(layer.input_layernorm, h), cos, sin)
            self.k[i].index_copy_(2, col, ks)
            self.v[i].index_copy_(2, col, vs)
            # One query token: the G query heads sharing a KV head go in the query-length dimension (head h reads
            # KV head h // G, as GQA does), so the masked kernel needs no GQA support and no repeated K/V.
            qg = qs.reshape(b, self.n_kv, self.n_heads // self.n_kv, self.head_dim)
            o = F.scaled_dot_product_attention(qg, self.k[i], self.v[i], attn_mask=self._open, scale=attn.scaling)
            h = h + attn.o_proj(o.reshape(b, 1, self.n_heads * self.head_dim))
            h = h + layer.mlp(_rms(layer.post_attention_layernorm, h))
        col.add_(1)
        self._pos.add_(1)
        return self.model.lm_head(_rms(self.inner.norm, h[:, -1]))
