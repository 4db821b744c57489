"""``shapes-sd3``: a small SD3-architecture text-to-image model for the shapes world, trained by the project.

It is an ordinary ``StableDiffusion3Pipeline`` (MMDiT transformer, CLIP x2 + T5 text encoders, an
``AutoencoderKL``), so the rollout engine, Flow-GRPO replay and the checkpoint store treat it like any SD3
model. What makes it learnable on a CPU:

- **Pixel space.** The "VAE" is an ``AutoencoderKL`` with one block whose weights are set by hand so that
  encode and decode are the identity on pixels (to ~1e-4): ``conv_in`` writes each colour channel as ``(+p,
  -p, +A, -A)`` into one GroupNorm group, whose statistics are then ~constant (mean 0, variance ~A^2 / 2);
  resnet blocks are zeroed to identities; after the final GroupNorm, ``SiLU(u) - SiLU(-u) = u`` recovers the
  value exactly. Latents are ``[3, H, W]`` pixels, shifted and scaled to unit variance over the shapes world
  (``shift_factor`` 0.87, ``scaling_factor`` 2.5). Nothing to train, nothing lost to compression.
- **Word-level tokenizer** over the world's fixed vocabulary (a literal list here, so ids never move), shared
  by the three text encoders; the encoders stay at their seeded random init (frozen, as in every bundle).
- **Small MMDiT**: 32x32 images, patch 2 -> 256 image tokens, ``SHAPES_SPEC`` below.

Presets (``DiffusionModelConfig.source``): ``shapes-sd3-init`` (random init from ``seed``: what SFT starts
from), ``shapes-sd3`` (the shipped weights ``weights/shapes-sd3.safetensors``: every component, so the
result does not depend on how this torch/transformers version initialises modules) and ``shapes-sd3-long`` (the
same architecture after a longer SFT, ``weights/shapes-sd3-long.safetensors``; see ``SHIPPED``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from unirl_core.errors import ConfigError, field_error

SHAPES_SIZE = 32
"""Image side the preset is sized for (pixels)."""
SHIPPED = {name: Path(__file__).resolve().parent / "weights" / f"{name}.safetensors"
           for name in ("shapes-sd3", "shapes-sd3-long")}
"""The presets with shipped weights: ``shapes-sd3`` (1,500 SFT steps of batch 32 on a CPU; held-out
``shapes_compositional`` 0.235) and ``shapes-sd3-long`` (2,500 steps of batch 128 on one H200,
``scripts/gpu_build_shapes.sh``; 0.360 on 128 held-out prompts; it reads the colour and shape words more
strongly, which the prompt-enhancement recipes need)."""
COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae")

VOCAB = ("<unk>", "<s>", "<pad>", "</s>", ",", ".", "a", "an", "one", "two", "three", "1", "2", "3",
         "red", "green", "blue", "yellow", "purple", "cyan", "white", "black",
         "circle", "circles", "square", "squares", "triangle", "triangles",
         "left", "right", "of", "to", "the", "above", "below", "and", "on", "in", "with")
"""Token ids of the word-level tokenizer (order fixed: the shipped weights depend on it)."""
_CLIP_LENGTH = 16
_T5_LENGTH = 32
_A = 100.0
"""Constant companion channel of the identity autoencoder (sets the GroupNorm variance; error ~ p^2 / A^2)."""
PIXEL_SHIFT = 0.87
PIXEL_SCALE = 2.5


@dataclass(frozen=True, kw_only=True)
class ShapesModelSpec:
    """Shape of the preset's transformer and text encoders."""

    layers: int = 4
    """MMDiT blocks."""
    patch: int = 2
    """Patch side: 32 / 2 = 16 x 16 = 256 image tokens."""
    heads: int = 4
    head_dim: int = 24
    """Width = heads x head_dim = 96."""
    clip_hidden: int = 32
    """Width of each CLIP encoder (pooled: 2 x 32)."""
    t5_dim: int = 64
    """T5 width = the transformer's joint_attention_dim."""


SHAPES_SPEC = ShapesModelSpec()


def word_tokenizer(model_max_length: int):
    """Lower-cased WordLevel tokenizer over ``VOCAB`` (``<s> ... </s>`` around every text, unknown -> ``<unk>``)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=model_max_length)


def pixel_autoencoder():
    """An ``AutoencoderKL`` whose encode (latent mean) and decode are the identity on ``[-1, 1]`` pixels."""
    from diffusers import AutoencoderKL

    c = 4 * 3
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), block_out_channels=(c,), layers_per_block=1,
                        latent_channels=3, norm_num_groups=3, sample_size=SHAPES_SIZE, scaling_factor=PIXEL_SCALE,
                        shift_factor=PIXEL_SHIFT, use_quant_conv=False, use_post_quant_conv=False,
                        mid_block_add_attention=False)
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        for coder in (vae.encoder, vae.decoder):
            _spread(coder.conv_in)
            for m in coder.modules():
                if type(m).__name__ == "ResnetBlock2D":
                    m.conv2.weight.zero_()  # already 0: the block is x + 0
            norm = coder.conv_norm_out
            norm.weight.copy_(torch.tensor([_A / 2 ** 0.5, _A / 2 ** 0.5, 0.0, 0.0] * 3))
        _collect(vae.encoder.conv_out, out_mean=3, logvar=-30.0)
        _collect(vae.decoder.conv_out, out_mean=3, logvar=None)
        for m in vae.modules():  # GroupNorms inside the zeroed resnets: any finite affine works, keep 1
            if isinstance(m, torch.nn.GroupNorm) and m not in (vae.encoder.conv_norm_out, vae.decoder.conv_norm_out):
                m.weight.fill_(1.0)
    return vae


def _spread(conv: torch.nn.Conv2d) -> None:
    """Channel c -> (+x_c, -x_c, +A, -A) in group c (centre tap; the constants are biases)."""
    for ch in range(3):
        conv.weight[4 * ch, ch, 1, 1] = 1.0
        conv.weight[4 * ch + 1, ch, 1, 1] = -1.0
        conv.bias[4 * ch + 2] = _A
        conv.bias[4 * ch + 3] = -_A


def _collect(conv: torch.nn.Conv2d, *, out_mean: int, logvar: float | None) -> None:
    """Output c = SiLU(+u_c) - SiLU(-u_c) = u_c; an encoder also emits a constant (tiny) log-variance."""
    for ch in range(out_mean):
        conv.weight[ch, 4 * ch, 1, 1] = 1.0
        conv.weight[ch, 4 * ch + 1, 1, 1] = -1.0
    if logvar is not None:
        conv.bias[out_mean:] = logvar


def shapes_sd3_pipeline(*, seed: int = 0, spec: ShapesModelSpec = SHAPES_SPEC):
    """The ``shapes-sd3-init`` pipeline: seeded random transformer and text encoders, identity pixel autoencoder."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    torch.manual_seed(seed)
    vocab = len(VOCAB)
    inner = spec.heads * spec.head_dim

    def clip():
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=vocab, hidden_size=spec.clip_hidden, intermediate_size=2 * spec.clip_hidden,
            projection_dim=spec.clip_hidden, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=_CLIP_LENGTH, bos_token_id=1, eos_token_id=3, pad_token_id=2, hidden_act="gelu"))

    t5 = T5EncoderModel(T5Config(vocab_size=vocab, d_model=spec.t5_dim, d_ff=2 * spec.t5_dim, d_kv=spec.t5_dim // 4,
                                 num_layers=2, num_heads=4, relative_attention_num_buckets=8, pad_token_id=2,
                                 eos_token_id=3, decoder_start_token_id=2))
    transformer = SD3Transformer2DModel(
        sample_size=SHAPES_SIZE, patch_size=spec.patch, in_channels=3, out_channels=3, num_layers=spec.layers,
        attention_head_dim=spec.head_dim, num_attention_heads=spec.heads, joint_attention_dim=spec.t5_dim,
        caption_projection_dim=inner, pooled_projection_dim=2 * spec.clip_hidden, pos_embed_max_size=SHAPES_SIZE // spec.patch)
    return StableDiffusion3Pipeline(
        transformer=transformer, vae=pixel_autoencoder(), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=clip(), tokenizer=word_tokenizer(_CLIP_LENGTH), text_encoder_2=clip(),
        tokenizer_2=word_tokenizer(_CLIP_LENGTH), text_encoder_3=t5, tokenizer_3=word_tokenizer(_T5_LENGTH))


def pipeline_state(pipe) -> dict[str, torch.Tensor]:
    """Every component's state dict under ``<component>.<name>`` (what a ``SHIPPED`` weights file holds)."""
    # cloned: tied tensors (T5 shared / embed_tokens) would share memory, which safetensors refuses to save
    return {f"{c}.{k}": v.detach().cpu().clone().contiguous() for c in COMPONENTS
            for k, v in getattr(pipe, c).state_dict().items()}


def load_pipeline_state(pipe, state: dict[str, torch.Tensor], *, where: str) -> None:
    """Load ``pipeline_state`` output into a freshly built pipeline; every tensor must fit (strict)."""
    for c in COMPONENTS:
        part = {k[len(c) + 1:]: v for k, v in state.items() if k.startswith(c + ".")}
        try:
            getattr(pipe, c).load_state_dict(part, strict=True)
        except RuntimeError as e:
            raise field_error(ConfigError, f"{where}: {c}", type(e).__name__, "weights of the shapes-sd3 architecture",
                              f"rebuild them with scripts/build_shapes_model.sh ({str(e)[:200]})") from e


def shipped_shapes_pipeline(name: str = "shapes-sd3"):
    """The pipeline of a preset in ``SHIPPED``: the architecture with that preset's shipped weights."""
    from safetensors.torch import load_file

    path = SHIPPED[name]
    if not path.is_file():
        raise field_error(ConfigError, "model.source", name, f"the shipped weights at {path.name}",
                          "reinstall the package, or use 'shapes-sd3-init' and train it (scripts/build_shapes_model.sh)")
    pipe = shapes_sd3_pipeline()
    load_pipeline_state(pipe, load_file(str(path)), where=path.name)
    return pipe


def pack_weights(pipeline_dir: str, out: str | Path) -> Path:
    """Write the weights file of a trained shapes-sd3 pipeline folder (an SFT export) for the ``shapes-sd3`` preset.

    The folder is loaded with ``from_pretrained`` and must have the preset's architecture (checked by loading
    the packed tensors strictly into a fresh ``shapes-sd3-init`` build before writing)."""
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import save_file

    state = pipeline_state(StableDiffusion3Pipeline.from_pretrained(pipeline_dir))
    load_pipeline_state(shapes_sd3_pipeline(), state, where=str(pipeline_dir))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata={"preset": "shapes-sd3", "source": Path(pipeline_dir).name})
    return out


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m examples.shapes.model <sft export folder> <out.safetensors>")
    print(pack_weights(sys.argv[1], sys.argv[2]))
