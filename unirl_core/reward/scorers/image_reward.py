"""ImageReward (Xu et al., 2023) on transformers' BLIP modules, reading the released ``ImageReward.pt`` without the
``image-reward`` package.

The model, as the package's ``ImageReward.score`` computes it: BLIP's ViT (ViT-L/16 at 224 px, LayerNorm eps 1e-6)
embeds the image ``[B, 1 + 14^2, 1024]``; BLIP's text encoder (a BERT-base with cross-attention to the image in
every layer) reads the prompt (``bert-base-uncased`` tokens, padded to 35) over those embeddings; the ``[CLS]``
hidden state ``[B, 768]`` goes through an MLP (768-1024-128-64-16-1, the LAION aesthetic head's shape) and the
score is ``(mlp - 0.16717362830052426) / 1.0333394966054072``. Images: bicubic resize of the short side to 224,
center crop, CLIP mean / std.

Checkpoint layout (``THUDM/ImageReward``, ``ImageReward.pt``: a bare state dict): ``blip.visual_encoder.``
``{cls_token, pos_embed, patch_embed.proj.*, blocks.{i}.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}.*,
norm.*}`` (timm's ViT names), ``blip.text_encoder.*`` (BLIP's BERT; transformers' ``BlipTextModel`` uses the same
names), ``mlp.layers.{0,2,4,6,7}.*``; its other keys (BLIP's decoder, projections, ITM head) are not used.
"""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Sequence

import fsspec
import torch
from torch import Tensor, nn

from unirl_core.errors import ConfigError, field_error
from unirl_core.reward.scorers.base import ScoreItem
from unirl_core.reward.scorers.clip import AestheticHead
from unirl_core.reward.scorers.image import decode_image

IMAGE_REWARD_CHECKPOINT = "hf://THUDM/ImageReward/ImageReward.pt"
"""ImageReward-v1.0's released weights on the Hugging Face hub."""
MEAN, STD = 0.16717362830052426, 1.0333394966054072
"""The package's normalisation of the MLP output."""
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
_VISION = {"cls_token": "embeddings.class_embedding", "pos_embed": "embeddings.position_embedding",
           "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
           "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
           "norm.weight": "post_layernorm.weight", "norm.bias": "post_layernorm.bias"}
_BLOCK = {"norm1": "layer_norm1", "attn.qkv": "self_attn.qkv", "attn.proj": "self_attn.projection",
          "norm2": "layer_norm2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
_USED = ("blip.visual_encoder.", "blip.text_encoder.", "mlp.layers.")


def convert_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """ImageReward checkpoint keys -> ``ImageRewardModel`` keys (``vision.``, ``text.``, ``mlp.``)."""
    out = {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            rest = key.removeprefix("blip.visual_encoder.")
            if m := re.match(r"blocks\.(\d+)\.(.+)\.(weight|bias)$", rest):
                rest = f"encoder.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
            else:
                rest = _VISION[rest]
            out[f"vision.{rest}"] = value
        elif key.startswith("blip.text_encoder."):
            out["text." + key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp.layers."):
            out[key] = value
    return out


def _count(state: dict[str, Tensor], pattern: str) -> int:
    return len({m.group(1) for k in state if (m := re.match(pattern, k))})


class ImageRewardModel(nn.Module):
    """BLIP ViT + BLIP text encoder with cross-attention + the reward MLP; ``forward`` -> [B] normalised rewards."""

    def __init__(self, state: dict[str, Tensor], *, vision_heads: int = 16, text_heads: int = 12) -> None:
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        super().__init__()
        pre = "blip.visual_encoder."
        width, _, patch, _ = state[f"{pre}patch_embed.proj.weight"].shape
        grid = round((state[f"{pre}pos_embed"].shape[1] - 1) ** 0.5)
        vision = BlipVisionConfig(hidden_size=int(width), num_attention_heads=vision_heads, patch_size=int(patch),
                                  image_size=int(grid * patch), layer_norm_eps=1e-6,
                                  num_hidden_layers=_count(state, rf"{pre}blocks\.(\d+)\."),
                                  intermediate_size=int(state[f"{pre}blocks.0.mlp.fc1.weight"].shape[0]))
        tpre = "blip.text_encoder."
        vocab, hidden = state[f"{tpre}embeddings.word_embeddings.weight"].shape
        text = BlipTextConfig(vocab_size=int(vocab), hidden_size=int(hidden), num_attention_heads=text_heads,
                              encoder_hidden_size=int(width), is_decoder=True,
                              num_hidden_layers=_count(state, rf"{tpre}encoder\.layer\.(\d+)\."),
                              intermediate_size=int(state[f"{tpre}encoder.layer.0.intermediate.dense.weight"].shape[0]),
                              max_position_embeddings=int(state[f"{tpre}embeddings.position_embeddings.weight"].shape[0]))
        for what, heads, w in (("vision_heads", vision_heads, width), ("text_heads", text_heads, hidden)):
            if w % heads:
                raise field_error(ConfigError, what, heads, f"a divisor of the width {int(w)}",
                                  "ImageReward-v1.0 has 16 vision heads (ViT-L) and 12 text heads (BERT-base)")
        self.image_size = int(grid * patch)
        self.vision = BlipVisionModel(vision)
        self.text = BlipTextModel(text, add_pooling_layer=False)
        self.mlp = AestheticHead(in_dim=int(hidden))
        result = self.load_state_dict(convert_state_dict(state), strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
        if missing or result.unexpected_keys:
            raise field_error(ConfigError, "ImageReward checkpoint", (missing or result.unexpected_keys)[:5],
                              "the released ImageReward.pt layout", f"load {IMAGE_REWARD_CHECKPOINT}")
        self.eval()

    def forward(self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        image = self.vision(pixel_values=pixel_values).last_hidden_state  # [B, 1 + grid^2, Wv]
        ones = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
        text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                         encoder_attention_mask=ones, is_decoder=False).last_hidden_state
        return (self.mlp(text[:, 0].float()) - MEAN) / STD


def read_image_reward(uri: str) -> dict[str, Tensor]:
    """The state dict at a local path or fsspec URI (``hf://``, ``s3://``, ``https://``), tensors only."""
    try:
        with fsspec.open(uri, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise field_error(ConfigError, "ImageReward checkpoint", uri, "an existing file or URI",
                          f"pass a local ImageReward.pt or {IMAGE_REWARD_CHECKPOINT}") from None
    obj = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not any(k.startswith(_USED[0]) for k in state):
        raise field_error(ConfigError, "ImageReward checkpoint", uri, "ImageReward's state dict "
                          "(blip.visual_encoder.*, blip.text_encoder.*, mlp.layers.*)", f"load {IMAGE_REWARD_CHECKPOINT}")
    return state


class ImageRewardScorer:
    """ImageReward: higher is better, about N(0, 1) over its training set's generations."""

    def __init__(self, model: str = IMAGE_REWARD_CHECKPOINT, tokenizer: str = "bert-base-uncased",
                 device: str = "cpu", dtype: str = "float32", vision_heads: int = 16, text_heads: int = 12,
                 max_length: int = 35, max_batch: int = 16) -> None:
        from transformers import AutoTokenizer, CLIPImageProcessor

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in dtypes:
            raise field_error(ConfigError, "image_reward dtype", dtype, f"one of {sorted(dtypes)}", "use float32")
        self.device = torch.device(device)
        net = ImageRewardModel(read_image_reward(model), vision_heads=vision_heads, text_heads=text_heads)
        self.model = net.to(self.device, dtypes[dtype]).requires_grad_(False)
        self.model.mlp.float()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        # BLIP's tokenizer: bert-base-uncased plus [DEC] (bos) and [ENC]; the prompt's ids are BERT's own.
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
        size = self.model.image_size
        self.images = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                         resample=3, image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD))
        self.max_length, self.max_batch = max_length, max_batch
        self._lock = threading.Lock()

    @torch.no_grad()
    def _chunk(self, items: Sequence[ScoreItem]) -> list[float]:
        px = self.images(images=[decode_image(it) for it in items], return_tensors="pt")["pixel_values"]
        tok = self.tokenizer([it.prompt for it in items], padding="max_length", truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        dtype = self.model.vision.embeddings.patch_embedding.weight.dtype
        return self.model(px.to(self.device, dtype), tok["input_ids"].to(self.device),
                          tok["attention_mask"].to(self.device)).float().tolist()

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        with self._lock:
            return [s for i in range(0, len(items), self.max_batch) for s in self._chunk(items[i:i + self.max_batch])]
