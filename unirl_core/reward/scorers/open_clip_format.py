"""open_clip checkpoints (HPS-v2's public format) as a transformers ``CLIPModel``, without open_clip installed.

HPS-v2 (Wu et al., 2023) releases ``HPS_v2_compressed.pt`` / ``HPS_v2.1_compressed.pt`` (hub repo ``xswu/HPSv2``):
``torch.save({"state_dict": ...})`` of an open_clip ``ViT-H-14`` CLIP. Its key layout (open_clip's ``CLIP`` with a
``VisionTransformer`` and a text ``Transformer`` of ``ResidualAttentionBlock`` s over ``nn.MultiheadAttention``):

- text: ``token_embedding.weight`` [V, W], ``positional_embedding`` [L, W], ``transformer.resblocks.{i}.``
  ``{ln_1, ln_2}.{weight,bias}``, ``attn.in_proj_{weight,bias}`` ([3W, W]: q, k, v stacked),
  ``attn.out_proj.{weight,bias}``, ``mlp.c_fc.*``, ``mlp.c_proj.*``; ``ln_final.*``; ``text_projection`` [W, D]
  (applied as ``x @ text_projection``);
- vision: ``visual.conv1.weight`` [W, 3, p, p] (no bias), ``visual.class_embedding`` [W],
  ``visual.positional_embedding`` [1 + (S/p)^2, W], ``visual.ln_pre.*``, ``visual.transformer.resblocks.{i}.*``
  (as above), ``visual.ln_post.*``, ``visual.proj`` [W, D];
- ``logit_scale`` (a scalar, log of the scale).

Everything but the head counts is read from the shapes; open_clip's config holds the heads (ViT-H-14: 16 text heads
of width 64, 16 vision heads of width 80, exact GELU), hence ``VIT_H_14``. The text feature is taken at the
end-of-text token, which open_clip finds as the largest id (``argmax``): the converted config's ``eos_token_id`` is
the last vocabulary id (49407 for ViT-H-14's tokenizer), where transformers' CLIP pools the same position.

``python -m unirl_core.reward.scorers.open_clip_format <checkpoint> <out dir> [--processor ID]`` writes the converted
model (and, with ``--processor``, that processor) as a ``from_pretrained`` folder.
"""

from __future__ import annotations

import argparse
import io
import re

import fsspec
import torch
from torch import Tensor

from unirl_core.errors import ConfigError, field_error

VIT_H_14 = {"text_heads": 16, "vision_heads": 16, "hidden_act": "gelu"}
"""open_clip's ViT-H-14 settings that its state dict does not hold (HPS-v2's architecture)."""
HPSV2_CHECKPOINT = "hf://xswu/HPSv2/HPS_v2.1_compressed.pt"
"""HPS-v2.1's public checkpoint on the Hugging Face hub (``HPS_v2_compressed.pt`` beside it is v2.0)."""
CLIP_H_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
"""The tokenizer and image preprocessing of open_clip's ViT-H-14 (224 px, CLIP mean/std), as a transformers id."""
_BLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.")


def read_checkpoint(uri: str) -> dict[str, Tensor]:
    """The state dict of an open_clip checkpoint at a local path or fsspec URI (``hf://``, ``s3://``, ...): a
    ``{"state_dict": ...}`` file or a bare state dict, tensors only (``weights_only``), ``module.`` prefixes off."""
    try:
        with fsspec.open(uri, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise field_error(ConfigError, "open_clip checkpoint", uri, "an existing file or URI",
                          f"pass a local .pt path or e.g. {HPSV2_CHECKPOINT}") from None
    obj = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or "visual.conv1.weight" not in {k.removeprefix("module.") for k in state}:
        raise field_error(ConfigError, "open_clip checkpoint", uri, "an open_clip CLIP state dict "
                          "(visual.conv1.weight, transformer.resblocks.*, ...)", "pass HPS-v2's released .pt file")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _layers(state: dict[str, Tensor], visual: bool) -> int:
    return len({int(m.group(2)) for k in state if (m := _BLOCK.match(k)) and bool(m.group(1)) == visual})


def _block(state: dict[str, Tensor], src: str, dst: str, out: dict[str, Tensor]) -> None:
    q, k, v = state[f"{src}attn.in_proj_weight"].chunk(3)
    qb, kb, vb = state[f"{src}attn.in_proj_bias"].chunk(3)
    for name, w, b in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
        out[f"{dst}self_attn.{name}.weight"], out[f"{dst}self_attn.{name}.bias"] = w, b
    pairs = {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2",
             "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for a, b in pairs.items():
        for p in ("weight", "bias"):
            out[f"{dst}{b}.{p}"] = state[f"{src}{a}.{p}"]


def clip_config(state: dict[str, Tensor], *, text_heads: int, vision_heads: int, hidden_act: str = "gelu"):
    """The transformers ``CLIPConfig`` of an open_clip state dict (sizes from its shapes, heads as given)."""
    from transformers import CLIPConfig

    vocab, text_width = state["token_embedding.weight"].shape
    width, _, patch, _ = state["visual.conv1.weight"].shape
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    text = dict(vocab_size=int(vocab), hidden_size=int(text_width), num_attention_heads=text_heads,
                intermediate_size=int(state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
                num_hidden_layers=_layers(state, False), hidden_act=hidden_act,
                max_position_embeddings=int(state["positional_embedding"].shape[0]),
                bos_token_id=int(vocab) - 2, eos_token_id=int(vocab) - 1, pad_token_id=0)
    vision = dict(hidden_size=int(width), num_attention_heads=vision_heads, patch_size=int(patch),
                  image_size=int(grid * patch), num_hidden_layers=_layers(state, True), hidden_act=hidden_act,
                  intermediate_size=int(state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]))
    for what, heads, w in (("text_heads", text_heads, text_width), ("vision_heads", vision_heads, width)):
        if w % heads:
            raise field_error(ConfigError, what, heads, f"a divisor of the width {int(w)}",
                              "pass the heads of the checkpoint's open_clip architecture (ViT-H-14: 16 and 16)")
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=int(state["visual.proj"].shape[1]))


def convert_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """open_clip keys -> transformers ``CLIPModel`` keys (q/k/v split, projections transposed)."""
    out = {"logit_scale": state["logit_scale"].reshape(()),
           "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
           "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
           "text_model.final_layer_norm.weight": state["ln_final.weight"],
           "text_model.final_layer_norm.bias": state["ln_final.bias"],
           "text_projection.weight": state["text_projection"].t(),
           "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
           "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
           "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
           "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
           "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
           "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
           "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
           "visual_projection.weight": state["visual.proj"].t()}
    for i in range(_layers(state, False)):
        _block(state, f"transformer.resblocks.{i}.", f"text_model.encoder.layers.{i}.", out)
    for i in range(_layers(state, True)):
        _block(state, f"visual.transformer.resblocks.{i}.", f"vision_model.encoder.layers.{i}.", out)
    return {k: v.contiguous() for k, v in out.items()}


def convert(state: dict[str, Tensor], *, text_heads: int = 16, vision_heads: int = 16, hidden_act: str = "gelu"):
    """A transformers ``CLIPModel`` (fp32, eval) holding an open_clip state dict's weights; every key is used."""
    from transformers import CLIPModel

    model = CLIPModel(clip_config(state, text_heads=text_heads, vision_heads=vision_heads, hidden_act=hidden_act))
    weights = convert_state_dict(state)
    result = model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        raise field_error(ConfigError, "open_clip checkpoint", (missing or result.unexpected_keys)[:5],
                          "a CLIP of open_clip's VisionTransformer + text Transformer layout",
                          "convert only open_clip CLIP checkpoints (ViT-H-14 for HPS-v2)")
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unirl_core.reward.scorers.open_clip_format",
                                 description="Convert an open_clip CLIP checkpoint (e.g. HPS-v2) to a transformers "
                                             "CLIPModel folder.")
    ap.add_argument("checkpoint", help=f"local .pt path or fsspec URI, e.g. {HPSV2_CHECKPOINT}")
    ap.add_argument("out", help="folder to write (save_pretrained)")
    ap.add_argument("--text-heads", type=int, default=VIT_H_14["text_heads"])
    ap.add_argument("--vision-heads", type=int, default=VIT_H_14["vision_heads"])
    ap.add_argument("--processor", default=None, help=f"also save this processor into the folder, e.g. "
                                                       f"{CLIP_H_PROCESSOR}")
    args = ap.parse_args(argv)
    convert(read_checkpoint(args.checkpoint), text_heads=args.text_heads,
            vision_heads=args.vision_heads).save_pretrained(args.out)
    if args.processor:
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(args.processor).save_pretrained(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
