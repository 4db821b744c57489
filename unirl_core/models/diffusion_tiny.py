"""Tiny SD3 / Flux pipelines built from config with seeded random init: the offline default.

They run 10 steps at 64x64 on one CPU core in a fraction of a second and exercise exactly the
code paths of the real models (MMDiT joint attention, CLIP x2 + T5 conditioning, VAE decode).

Tokenizer: a character-level ``tokenizers`` WordLevel model (printable ASCII, one token per
character, ``<s> ... </s>`` around every prompt) wrapped in ``PreTrainedTokenizerFast``. It needs no
download and no training, so the same ids come out on every machine; it is shared by the CLIP and
T5 slots. Random weights mean the images are noise-like textures; that is enough for RL plumbing
and for rewards that look at pixel statistics.
"""

from __future__ import annotations

import torch

TINY_HEIGHT = 64
"""Default image size of the tiny presets (pixels)."""
TINY_MAX_SEQUENCE_LENGTH = 32
"""T5 context of the tiny presets (the real models use 256 / 512)."""
_CLIP_MAX_LENGTH = 77
_SPECIALS = ("<unk>", "<s>", "<pad>", "</s>")


def char_tokenizer(model_max_length: int = _CLIP_MAX_LENGTH):
    """Character-level tokenizer (ids: 0 unk, 1 bos, 2 pad, 3 eos, then ASCII 32..126)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(list(_SPECIALS) + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 3)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=model_max_length)


def _clip_config(vocab: int, hidden: int, *, projection: bool):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, projection_dim=hidden,
                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=_CLIP_MAX_LENGTH,
                          bos_token_id=1, eos_token_id=3, pad_token_id=2, hidden_act="gelu")


def _t5(vocab: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab, d_model=d_model, d_ff=2 * d_model, d_kv=d_model // 4,
                                   num_layers=2, num_heads=4, relative_attention_num_buckets=8, pad_token_id=2,
                                   eos_token_id=3, decoder_start_token_id=2))


def _tiny_vae(latent_channels: int):
    from diffusers import AutoencoderKL

    # Four blocks give the 8x spatial compression of the real VAEs.
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16),
                         layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
                         sample_size=TINY_HEIGHT, scaling_factor=1.5305, shift_factor=0.0609)


def tiny_sd3_pipeline(*, seed: int = 0, sd35: bool = False):
    """A ``StableDiffusion3Pipeline`` (2-layer MMDiT, tiny VAE, CLIP-L/G-shaped x2, T5) from config.

    ``sd35``: SD3.5-Medium's transformer features at the same tiny width (``tiny-sd35``): MMDiT-X (the first block
    also attends over the image tokens alone, ``dual_attention_layers``), RMS-normalised q/k, 16 latent channels."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tok = char_tokenizer()
    vocab = len(tok)
    channels = 16 if sd35 else 4
    extra = dict(dual_attention_layers=(0,), qk_norm="rms_norm") if sd35 else {}
    transformer = SD3Transformer2DModel(sample_size=TINY_HEIGHT // 8, patch_size=2, in_channels=channels,
                                        out_channels=channels, num_layers=2, attention_head_dim=16,
                                        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=64,
                                        pooled_projection_dim=64, pos_embed_max_size=32, **extra)
    return StableDiffusion3Pipeline(
        transformer=transformer, vae=_tiny_vae(channels), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=CLIPTextModelWithProjection(_clip_config(vocab, 32, projection=True)), tokenizer=tok,
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(vocab, 32, projection=True)), tokenizer_2=tok,
        text_encoder_3=_t5(vocab, 64), tokenizer_3=char_tokenizer(model_max_length=TINY_MAX_SEQUENCE_LENGTH),
    )


def tiny_flux_pipeline(*, seed: int = 0, guidance_embeds: bool = False):
    """A ``FluxPipeline`` (1 double + 1 single block, tiny VAE, CLIP, T5) from config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    tok = char_tokenizer()
    vocab = len(tok)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, out_channels=None, num_layers=1,
                                         num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                         joint_attention_dim=64, pooled_projection_dim=32,
                                         guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(transformer=transformer, vae=_tiny_vae(4), scheduler=scheduler,
                        text_encoder=CLIPTextModel(_clip_config(vocab, 32, projection=False)), tokenizer=tok,
                        text_encoder_2=_t5(vocab, 64),
                        tokenizer_2=char_tokenizer(model_max_length=TINY_MAX_SEQUENCE_LENGTH))
