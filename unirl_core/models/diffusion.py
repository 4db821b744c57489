"""Diffusion model bundle over diffusers: SD3 and Flux families, tiny presets, LoRA or full fine-tune.

The bundle is what both the trainside engine and Flow-GRPO replay call, so the two run the very
same ops: ``velocity`` (one transformer forward on a batch, CFG included) is the only way a latent
meets the transformer. It is also the ``Policy`` the train backend sees (``module``, ``reference``).

Shapes: latents ``[B, C, h, w]`` (unpacked, also for Flux), sigma a 0-d float32 tensor, conditions
``prompt_embeds [B, L, D]`` and ``pooled_prompt_embeds [B, P]`` (batched) or ``[L, D]`` / ``[P]``
(per sample, as stored on a Part).
"""

from __future__ import annotations

import copy
import io
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from unirl_core.errors import ConfigError, field_error
from unirl_core.models.cuda_graphs import TrainGraphs
from unirl_core.models.lora import apply_lora, load_adapter, lora_disabled, lora_layers
from unirl_core.models.precision import compute_context
from unirl_core.models.presets import diffusion_preset

logger = logging.getLogger(__name__)

DiffusionFamily = Literal["sd3", "flux"]
FAMILIES: tuple[str, ...] = ("sd3", "flux")
TINY_PRESETS = {"tiny-sd3": "sd3", "tiny-sd35": "sd3", "tiny-flux": "flux", "tiny-flux-guidance": "flux"}
"""Presets built in code (no download); their T5 context is 32 tokens. Plugins add theirs
(``unirl_core.models.presets``; see ``is_preset``)."""


def is_preset(source: str) -> bool:
    """A model built in code (the library's tiny presets or a plugin's), no download."""
    return source in TINY_PRESETS or diffusion_preset(source) is not None
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

LORA_TARGETS: dict[str, tuple[str, ...]] = {
    # Joint-attention projections of both streams (the Flow-GRPO SD3 choice).
    "sd3": ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"),
    # Double blocks: both attention streams and both MLPs; single blocks: to_q/k/v (same names) and
    # their MLP input. Not "proj_out": that name also matches the model's final output layer.
    "flux": ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
             "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
             "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"),
}
_PIPELINE_FAMILY = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}
COND_KEYS = ("prompt_embeds", "pooled_prompt_embeds")
NEG_PREFIX = "negative_"
CFG_PREFIX = "cfg_"


@dataclass(frozen=True, kw_only=True)
class LoRASpec:
    """LoRA adapter shape."""

    rank: int = 8
    """Adapter rank r."""
    alpha: float = 8.0
    """Scale numerator; the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Adapter dropout; keep 0.0 so rollout and replay see the same forward."""
    target_modules: tuple[str, ...] | None = None
    """Module-name suffixes to wrap; None uses the family default (``LORA_TARGETS``)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise field_error(ConfigError, "lora.rank", self.rank, "an integer >= 1", "use e.g. 8 or 32")
        if self.dropout != 0.0:
            raise field_error(ConfigError, "lora.dropout", self.dropout, "0.0",
                              "dropout makes the replayed forward differ from the rollout forward")


@dataclass(frozen=True, kw_only=True)
class DiffusionModelConfig:
    """Which diffusion model to load and how to train it."""

    source: str = "tiny-sd3"
    """``tiny-sd3`` / ``tiny-sd35`` (SD3.5-Medium's MMDiT-X and q/k norm) / ``tiny-flux`` / ``tiny-flux-guidance``
    (built from config), a plugin's preset
    (``unirl_core.models.presets``, e.g. ``shapes-sd3`` of ``examples/shapes``), or a local dir / hub id for
    ``from_pretrained``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of every component (and, by default, of the stored trajectory)."""
    device: str = "cpu"
    """Torch device the bundle lives on."""
    finetune: Literal["lora", "full"] = "lora"
    """``lora``: train an adapter, the reference is the adapter switched off; ``full``: train all weights."""
    lora: LoRASpec = field(default_factory=LoRASpec)
    """Adapter shape when ``finetune == 'lora'``."""
    adapter: str | None = None
    """A peft adapter folder (local path or fsspec URI, e.g. one written by ``python -m unirl_core.runs.export
    ... --format peft``) whose weights the LoRA starts from instead of its random init (``finetune: lora``; its
    ``adapter_config.json`` must have this ``lora`` shape). None: the seeded random init."""
    reference_copy: bool = True
    """Full fine-tune only: keep a frozen copy of the initial transformer as the KL reference."""
    seed: int = 0
    """Seed of the random init of the tiny presets and of a LoRA adapter's ``lora_A``."""
    max_sequence_length: int | None = None
    """T5 context length; None uses 32 for tiny presets, 256 for SD3 and 512 for Flux."""
    gradient_checkpointing: bool = False
    """Recompute transformer activations in backward (same forward numerics, less memory)."""
    cfg_batch: Literal["joint", "split"] = "joint"
    """How SD3's classifier-free guidance runs its two branches: ``joint`` batches ``[uncond; cond]`` into one
    forward of 2B rows (the diffusers pipeline's way), ``split`` runs two forwards of B rows. Rollout and replay
    share this field, so they run the same layout and the replay stays bit-exact either way. With ``split`` a loss
    that stops gradient at the unconditional branch (Flow-GRPO's default ``cfg_grad: cond``) runs that branch
    without autograd, so the backward covers B rows instead of 2B (faster, less activation memory). Flux runs
    its two branches as two forwards whatever this says."""
    cuda_graphs: Literal["never", "auto", "always"] = "never"
    """The trainer's loss forward and backward as CUDA graph replays (``unirl_core.models.cuda_graphs``): the
    same kernels as eager mode, without the host launching each (SD3.5-M at micro-batch 4 launches ~12,000 per
    trained timestep). ``auto`` uses them when the trainer is one unsharded CUDA process without activation
    checkpointing and runs eager otherwise; ``always`` requires them (an error names what prevents it). Each input
    shape keeps one forward's activations resident for the trainer's life. Rollout and reference forwards stay
    eager; the graphed forward gives their bits (the first-update check still runs)."""

    def __post_init__(self) -> None:
        if self.cuda_graphs not in ("never", "auto", "always"):
            raise field_error(ConfigError, "model.cuda_graphs", self.cuda_graphs, "'never', 'auto' or 'always'",
                              "use 'auto' on a single GPU, 'never' to run the trainer eager")
        if self.cuda_graphs == "always" and not str(self.device).startswith("cuda"):
            raise field_error(ConfigError, "model.cuda_graphs", "always", f"a CUDA model.device (got {self.device!r})",
                              "set model.cuda_graphs to 'auto' or 'never' on a CPU")
        if self.cuda_graphs == "always" and self.gradient_checkpointing:
            raise field_error(ConfigError, "model.cuda_graphs", "always", "model.gradient_checkpointing: false",
                              "pick one: recomputation reads the RNG state, which a graph capture forbids")
        if self.cfg_batch not in ("joint", "split"):
            raise field_error(ConfigError, "model.cfg_batch", self.cfg_batch, "'joint' or 'split'",
                              "use 'split' to train Flow-GRPO without a backward through the unconditional branch")
        if self.dtype not in DTYPES:
            raise field_error(ConfigError, "model.dtype", self.dtype, f"one of {tuple(DTYPES)}", "use 'bfloat16' on GPU")
        if self.finetune not in ("lora", "full"):
            raise field_error(ConfigError, "model.finetune", self.finetune, "'lora' or 'full'", "pick one")
        if not self.source:
            raise field_error(ConfigError, "model.source", self.source, "a preset name, directory or hub id",
                              "use 'tiny-sd3' for an offline run")
        if self.adapter is not None and self.finetune != "lora":
            raise field_error(ConfigError, "diffusion.model.adapter", self.adapter, "unset unless finetune: lora",
                              "set finetune: lora to start from an adapter, or unset the adapter")


class DiffusionBundle:
    """Transformer + VAE + text encoders of one pipeline; the trainable ``module`` is the transformer."""

    def __init__(self, pipeline, *, family: DiffusionFamily, config: DiffusionModelConfig) -> None:
        if family not in FAMILIES:
            raise field_error(ConfigError, "model.family", family, f"one of {FAMILIES}", "use an SD3 or Flux pipeline")
        self.pipeline = pipeline
        self.family: DiffusionFamily = family
        self.config = config
        self.dtype = DTYPES[config.dtype]
        self.device = torch.device(config.device)
        self._module: nn.Module = pipeline.transformer
        self._reference: nn.Module | None = None
        self._use_reference = False
        self._train_graphs: TrainGraphs | None = None
        self._lora_probe: nn.Module | None = None
        self.max_sequence_length = config.max_sequence_length or (
            32 if is_preset(config.source) else (256 if family == "sd3" else 512))
        vae = getattr(pipeline, "vae", None)
        self.vae_scale_factor = (2 ** (len(vae.config.block_out_channels) - 1) if vae is not None
                                 else pipeline.vae_scale_factor)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def build(cls, config: DiffusionModelConfig) -> DiffusionBundle:
        """Load (or build the tiny preset), cast, move, freeze the frozen parts and attach LoRA."""
        pipe, family = _load_pipeline(config)
        pipe.to(config.device)
        if is_preset(config.source) and DTYPES[config.dtype] != torch.float32:
            pipe.to(dtype=DTYPES[config.dtype])  # from_pretrained already loaded in the asked dtype
        for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            comp = getattr(pipe, name, None)
            if comp is not None:
                comp.requires_grad_(False).eval()
        return cls(pipe, family=family, config=config)._make_trainable()

    @classmethod
    def from_transformer(cls, transformer: nn.Module, *, family: DiffusionFamily, config: DiffusionModelConfig,
                         vae_scale_factor: int = 8) -> DiffusionBundle:
        """A transformer-only bundle: rollout loops and replay on stored conditions, no text encoders or VAE.

        Train workers need nothing else (conditions travel on the Part); benchmarks use it for
        full-size transformers. ``encode_text`` and ``decode`` raise on such a bundle.
        """
        p = next(transformer.parameters())
        if p.device != torch.device(config.device) or p.dtype != DTYPES[config.dtype]:
            transformer = transformer.to(device=config.device, dtype=DTYPES[config.dtype])
        holder = _TransformerOnly(transformer=transformer, vae_scale_factor=vae_scale_factor)
        return cls(holder, family=family, config=config)._make_trainable()

    def _make_trainable(self) -> DiffusionBundle:
        config, transformer = self.config, self._module
        if config.finetune == "lora":
            spec = config.lora
            targets = spec.target_modules or LORA_TARGETS[self.family]
            apply_lora(transformer, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
                       target_modules=targets, seed=config.seed)
            if config.adapter is not None:
                load_adapter(transformer, config.adapter, field="diffusion.model.adapter", rank=spec.rank,
                             alpha=spec.alpha, target_modules=targets)
        else:
            transformer.requires_grad_(True)
            if config.reference_copy:
                self._reference = copy.deepcopy(transformer).requires_grad_(False).eval()
        if config.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        logger.info("diffusion bundle %s (%s, %s, %s): %.2fM trainable params", config.source, self.family,
                    config.dtype, config.finetune,
                    sum(p.numel() for p in transformer.parameters() if p.requires_grad) / 1e6)
        return self

    # -- Policy -------------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype every forward computes in (the model dtype), whoever runs it."""
        return self.dtype

    def compute(self):
        """The policy's compute context: parameters read in ``compute_dtype`` (see ``models.precision``).

        Rollout, replay and the trainer all run the transformer inside it; ``velocity`` enters it itself.
        """
        return compute_context(self._module, self.dtype)

    @property
    def module(self) -> nn.Module:
        """The trainable transformer (the train backend may replace it with a wrapped one)."""
        return self._module

    @module.setter
    def module(self, wrapped: nn.Module) -> None:
        self._module = wrapped

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Forward through the reference policy: LoRA switched off, or the frozen initial copy."""
        if self.config.finetune == "lora":
            with lora_disabled(self._module):
                yield
            return
        if self._reference is None:
            raise field_error(ConfigError, "model.reference_copy", False, "True to evaluate a KL reference",
                              "set reference_copy=True or train with kl_beta=0")
        prev, self._use_reference = self._use_reference, True
        try:
            yield
        finally:
            self._use_reference = prev

    # -- geometry -----------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """``(C, h, w)`` of one unpacked latent for an image of ``height x width`` pixels."""
        # Both families split the latent into 2x2 patches (SD3 patchify, Flux packing).
        step = self.vae_scale_factor * 2
        if height % step or width % step:
            raise field_error(ConfigError, "sampling.height/width", (height, width), f"multiples of {step}",
                              "pick an image size the VAE and the 2x2 patches split evenly")
        channels = self.pipeline.transformer.config.in_channels // (4 if self.family == "flux" else 1)
        f = self.vae_scale_factor
        return channels, height // f, width // f

    def guidance_uses_negative(self, guidance_scale: float) -> bool:
        """Whether CFG runs an unconditional (negative-prompt) branch at this scale."""
        if self.family == "flux" and self.pipeline.transformer.config.guidance_embeds:
            return False  # guidance-distilled Flux takes the scale as an embedding instead
        return guidance_scale > 1.0

    # -- text ---------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(self, prompts: Sequence[str]) -> list[dict[str, Tensor]]:
        """Per-prompt conditions ``{"prompt_embeds": [L, D], "pooled_prompt_embeds": [P]}`` (model dtype)."""
        self._require("encode_prompt", "text encoders")
        texts = list(prompts)
        if self.family == "sd3":
            embeds, _, pooled, _ = self.pipeline.encode_prompt(
                prompt=texts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length)
        else:
            embeds, pooled, _ = self.pipeline.encode_prompt(
                prompt=texts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length)
        embeds, pooled = embeds.to(self.dtype), pooled.to(self.dtype)
        return [{"prompt_embeds": embeds[i], "pooled_prompt_embeds": pooled[i]} for i in range(len(texts))]

    def _require(self, attr: str, what: str) -> None:
        if getattr(self.pipeline, attr, None) is None:
            raise field_error(ConfigError, "bundle", "transformer-only", f"a bundle with {what}",
                              "build it with DiffusionBundle.build(...) to encode prompts or decode images")

    # -- transformer --------------------------------------------------------------------------
    def _transformer(self) -> nn.Module:
        return self._reference if self._use_reference else self._module

    def attach_trainer(self, named_masters: Sequence[tuple[str, nn.Parameter]], *, sharded: bool) -> None:
        """Called by the train backend that owns this bundle, once its trainable parameters are final:
        builds the CUDA graphs of the loss forward when ``model.cuda_graphs`` asks for them."""
        mode = self.config.cuda_graphs
        if mode == "never":
            return
        blocker = None
        if self.device.type != "cuda":
            blocker = ("model.device", self.config.device, "a CUDA device", "set model.cuda_graphs: 'never' on a CPU")
        elif sharded:
            blocker = ("train.shard", "sharded (FSDP2)", "one unsharded trainer process",
                       "set model.cuda_graphs: 'never' (or 'auto') when the trainer is sharded")
        elif self.config.gradient_checkpointing:
            blocker = ("model.gradient_checkpointing", True, "false with CUDA graphs",
                       "set model.cuda_graphs: 'never' (or 'auto') with activation checkpointing")
        if blocker is not None:
            if mode == "always":
                raise field_error(ConfigError, *blocker)
            logger.info("model.cuda_graphs=auto: the trainer runs eager (%s is %s)", blocker[0], blocker[1])
            return
        self._train_graphs = TrainGraphs(self._module, named_masters, compute_dtype=self.dtype)
        layers = lora_layers(self._module) if self.config.finetune == "lora" else []
        self._lora_probe = layers[0] if layers else None

    @property
    def train_graphs(self) -> TrainGraphs | None:
        """The trainer's CUDA graphs (``model.cuda_graphs``), or None when its forwards run eager."""
        return self._train_graphs

    def _call_transformer(self, model: nn.Module, tensors: dict[str, Tensor], **static) -> Tensor:
        """``model(**tensors, **static)[0]``: a graph replay for the trainer's loss forward (autograd on, the
        trainable weights in use: adapter on, not the reference copy), eager for everything else."""
        graphs = self._train_graphs
        if (graphs is not None and model is self._module and torch.is_grad_enabled()
                and not (self._lora_probe is not None and self._lora_probe.disable_adapters)):
            return graphs(tensors, static)
        return model(**tensors, **static)[0]

    def velocity(self, latents: Tensor, sigma: Tensor, conds: dict[str, Tensor], *,
                 guidance_scale: float = 1.0) -> Tensor:
        """One transformer forward: ``[B, C, h, w]`` latents (model dtype) -> velocity ``[B, C, h, w]``."""
        with self.compute():
            return self._velocity(latents, sigma, conds, guidance_scale=guidance_scale)

    def _velocity(self, latents: Tensor, sigma: Tensor, conds: dict[str, Tensor], *, guidance_scale: float) -> Tensor:
        model = self._transformer()
        b = latents.shape[0]
        if self.family == "sd3":
            timestep = (sigma * 1000).expand(b)  # diffusers' timesteps are sigmas * num_train_timesteps
            tensors = dict(hidden_states=latents, encoder_hidden_states=conds["prompt_embeds"],
                           pooled_projections=conds["pooled_prompt_embeds"], timestep=timestep)
            return self._call_transformer(model, tensors, return_dict=False)
        from diffusers import FluxPipeline as pipe  # packing helpers are static methods

        c, h, w = latents.shape[1:]
        packed = pipe._pack_latents(latents, b, c, h, w)
        img_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, latents.dtype)
        txt_ids = torch.zeros(conds["prompt_embeds"].shape[1], 3, device=latents.device, dtype=latents.dtype)
        guidance = None
        if model.config.guidance_embeds:
            guidance = torch.full((b,), guidance_scale, device=latents.device, dtype=torch.float32)
        # Flux takes the sigma itself (the pipeline's t / 1000), passed exactly as pinned.
        tensors = dict(hidden_states=packed, timestep=sigma.expand(b).to(latents.dtype),
                       pooled_projections=conds["pooled_prompt_embeds"], encoder_hidden_states=conds["prompt_embeds"],
                       txt_ids=txt_ids, img_ids=img_ids)
        if guidance is not None:
            tensors["guidance"] = guidance
        out = self._call_transformer(model, tensors, return_dict=False)
        return pipe._unpack_latents(out, h * self.vae_scale_factor, w * self.vae_scale_factor, self.vae_scale_factor)

    def prepare_cfg(self, conds: dict[str, Tensor], *, guidance_scale: float) -> dict[str, Tensor]:
        """Add the ``[uncond; cond]`` concatenations once per slice instead of once per step (same values)."""
        if self.family != "sd3" or self.config.cfg_batch == "split" or not self.guidance_uses_negative(guidance_scale):
            return conds
        out = dict(conds)
        out.update({CFG_PREFIX + k: torch.cat([conds[NEG_PREFIX + k], conds[k]]) for k in COND_KEYS})
        return out

    def guided_velocity(self, latents: Tensor, sigma: Tensor, conds: dict[str, Tensor], *,
                        guidance_scale: float, uncond_grad: bool = True) -> Tensor:
        """CFG velocity in fp32. ``conds`` holds ``negative_*`` keys when the unconditional branch runs.

        SD3 batches ``[uncond; cond]`` into one forward of 2B (as its pipeline does) unless ``cfg_batch`` is
        ``split``; Flux runs two forwards (as its true-CFG path does). Rollout and replay both come through here.
        ``uncond_grad=False`` stops gradient at the unconditional branch (same values, bitwise); with two
        forwards that branch then runs under ``no_grad`` (forward kernels do not depend on the grad mode).
        """
        x = latents.to(self.dtype)
        if not self.guidance_uses_negative(guidance_scale):
            return self.velocity(x, sigma, conds, guidance_scale=guidance_scale).float()
        neg = {k: conds[NEG_PREFIX + k] for k in COND_KEYS}
        if self.family == "sd3" and self.config.cfg_batch == "joint":
            both = {k: conds[CFG_PREFIX + k] if CFG_PREFIX + k in conds else torch.cat([neg[k], conds[k]])
                    for k in COND_KEYS}
            v_u, v_c = self.velocity(torch.cat([x, x]), sigma, both).float().chunk(2)
            if not uncond_grad:
                v_u = v_u.detach()
        else:
            v_c = self.velocity(x, sigma, conds).float()
            with torch.set_grad_enabled(uncond_grad and torch.is_grad_enabled()):
                v_u = self.velocity(x, sigma, neg).float()
        return v_u + guidance_scale * (v_c - v_u)

    # -- images -------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, C, h, w]`` -> uint8 images ``[B, H, W, 3]`` on CPU."""
        self._require("vae", "a VAE")
        vae = self.pipeline.vae
        z = latents.to(device=self.device, dtype=vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        img = vae.decode(z, return_dict=False)[0]
        img = ((img.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return img.permute(0, 2, 3, 1).cpu()

    def decode_png(self, latents: Tensor) -> list[bytes]:
        """Latents -> PNG bytes per image."""
        from PIL import Image

        out = []
        for arr in self.decode(latents).numpy():
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="PNG")
            out.append(buf.getvalue())
        return out


@dataclass
class _TransformerOnly:
    """Stands in for a pipeline when only the transformer exists."""

    transformer: nn.Module
    vae_scale_factor: int = 8
    vae: None = None
    encode_prompt: None = None


def stack_conditions(conds: list[dict[str, Tensor]], device: torch.device) -> dict[str, Tensor]:
    """Per-sample conditions -> one batched dict (the same op in rollout and replay)."""
    return {k: torch.stack([c[k] for c in conds]).to(device) for k in conds[0]}


def _load_pipeline(config: DiffusionModelConfig):
    from unirl_core.models import diffusion_tiny

    if config.source in ("tiny-sd3", "tiny-sd35"):
        return diffusion_tiny.tiny_sd3_pipeline(seed=config.seed, sd35=config.source == "tiny-sd35"), "sd3"
    preset = diffusion_preset(config.source)
    if preset is not None:
        return preset.build(config), preset.family
    if config.source in ("tiny-flux", "tiny-flux-guidance"):
        return diffusion_tiny.tiny_flux_pipeline(seed=config.seed,
                                                 guidance_embeds=config.source == "tiny-flux-guidance"), "flux"
    import diffusers
    from diffusers import DiffusionPipeline
    from packaging.version import Version

    # diffusers renamed torch_dtype to dtype (0.42); older releases only know torch_dtype.
    key = "dtype" if Version(diffusers.__version__) >= Version("0.42") else "torch_dtype"
    pipe = DiffusionPipeline.from_pretrained(config.source, **{key: DTYPES[config.dtype]})
    family = _PIPELINE_FAMILY.get(type(pipe).__name__)
    if family is None:
        raise field_error(ConfigError, "model.source", config.source,
                          f"an SD3 or Flux pipeline ({', '.join(_PIPELINE_FAMILY)})",
                          f"got {type(pipe).__name__}; point the source at an SD3/SD3.5 or Flux checkpoint")
    return pipe, family
