"""CLIP-family preference scorers: PickScore, HPS-v2, CLIP score, LAION aesthetic.

All load a transformers ``CLIPModel`` and a processor with ``from_pretrained`` (a local
directory or a hub id); HPS-v2 also reads its public open_clip checkpoint (``open_clip_format``); the aesthetic
head is a small MLP read from a local file or an fsspec URI. Scores use L2-normalised projected embeddings:

- PickScore: ``logit_scale.exp() * cos(image, prompt) / divisor`` (Flow-GRPO divides by 26);
- HPS-v2:    ``cos(image, prompt)`` of the HPS-tuned CLIP (an open_clip checkpoint converted on load, or a
  transformers folder);
- CLIP score: ``w * max(cos(image, prompt), 0)`` with ``w = 2.5`` (Hessel et al., 2021);
- aesthetic: ``MLP(normalised image embedding)``, LAION's improved-aesthetic-predictor head.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence

import fsspec
import torch
from torch import Tensor, nn

from unirl_core.errors import ConfigError, field_error
from unirl_core.reward.scorers.base import ScoreItem
from unirl_core.reward.scorers.image import decode_image
from unirl_core.reward.scorers.open_clip_format import (
    CLIP_H_PROCESSOR,
    HPSV2_CHECKPOINT,
    VIT_H_14,
    convert,
    read_checkpoint,
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _features(out) -> Tensor:
    # transformers < 5 returns the projected tensor; 5.x wraps it in an output's pooler_output.
    return out if isinstance(out, Tensor) else out.pooler_output


def _normalise(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)


class ClipEmbedder:
    """A CLIP model + processor pair that embeds images and prompts ([B, D] normalised, fp32)."""

    def __init__(self, model, processor: str | None = None, device: str = "cpu", dtype: str = "float32",
                 max_batch: int = 16) -> None:
        """``model``: a directory / hub id for ``CLIPModel.from_pretrained``, or a built ``CLIPModel``."""
        from transformers import AutoProcessor, CLIPModel  # lazy: keep `import unirl_core.reward` light

        if dtype not in _DTYPES:
            raise field_error(ConfigError, "clip scorer dtype", dtype, f"one of {sorted(_DTYPES)}",
                              "use float32 on CPU, bfloat16 / float16 on GPU")
        self.device = torch.device(device)
        if isinstance(model, str):
            processor = processor or model
            model = CLIPModel.from_pretrained(model, dtype=_DTYPES[dtype])
        else:
            model = model.to(_DTYPES[dtype])
            if processor is None:
                raise field_error(ConfigError, "clip scorer processor", None, "a processor directory or hub id",
                                  "pass processor= for a converted model")
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.processor = AutoProcessor.from_pretrained(processor)
        self.max_batch = max_batch
        self._max_text = int(self.model.config.text_config.max_position_embeddings)
        self._lock = threading.Lock()

    @torch.no_grad()
    def _chunk_images(self, items: Sequence[ScoreItem]) -> Tensor:
        px = self.processor(images=[decode_image(it) for it in items], return_tensors="pt")["pixel_values"]
        px = px.to(self.device, self.model.dtype)
        return _normalise(_features(self.model.get_image_features(pixel_values=px)).float())

    @torch.no_grad()
    def _chunk_texts(self, texts: list[str]) -> Tensor:
        tok = self.processor(text=texts, padding=True, truncation=True, max_length=self._max_text,
                             return_tensors="pt")
        ids, mask = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device)
        return _normalise(_features(self.model.get_text_features(input_ids=ids, attention_mask=mask)).float())

    def images(self, items: Sequence[ScoreItem]) -> Tensor:
        """[B, D] normalised image embeddings."""
        with self._lock:
            return torch.cat([self._chunk_images(items[i:i + self.max_batch])
                              for i in range(0, len(items), self.max_batch)])

    def texts(self, texts: Sequence[str]) -> Tensor:
        """[B, D] normalised prompt embeddings."""
        with self._lock:
            return torch.cat([self._chunk_texts(list(texts[i:i + self.max_batch]))
                              for i in range(0, len(texts), self.max_batch)])

    def cosine(self, items: Sequence[ScoreItem]) -> Tensor:
        """[B] cosine similarity of each image with its own prompt."""
        return (self.images(items) * self.texts([it.prompt for it in items])).sum(-1)


class PickScoreScorer:
    """PickScore (Kirstain et al., 2023): CLIP-H fine-tuned on Pick-a-Pic preferences."""

    def __init__(self, model: str = "yuvalkirstain/PickScore_v1",
                 processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", divisor: float = 1.0,
                 device: str = "cpu", dtype: str = "float32") -> None:
        self.clip = ClipEmbedder(model, processor, device, dtype)
        self.divisor = divisor

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        scale = float(self.clip.model.logit_scale.exp())
        return (self.clip.cosine(items) * scale / self.divisor).tolist()


class HPSv2Scorer:
    """HPS-v2 (Wu et al., 2023): cosine of image and prompt under the HPS-tuned CLIP-H.

    ``model``: an open_clip checkpoint (a path or fsspec URI ending in ``.pt`` / ``.pth`` / ``.bin``; default the
    public HPS-v2.1 one, ``hf://xswu/HPSv2/HPS_v2.1_compressed.pt``), converted in memory with
    ``open_clip_format.convert`` (``text_heads`` / ``vision_heads``: ViT-H-14's 16 / 16), or a transformers CLIP
    folder / hub id (e.g. written by ``python -m unirl_core.reward.scorers.open_clip_format``). ``processor``: None
    uses the model folder's own, or the LAION CLIP-H one for a checkpoint (open_clip ViT-H-14's tokenizer and
    preprocessing)."""

    def __init__(self, model: str = HPSV2_CHECKPOINT, processor: str | None = None, device: str = "cpu",
                 dtype: str = "float32", text_heads: int = VIT_H_14["text_heads"],
                 vision_heads: int = VIT_H_14["vision_heads"]) -> None:
        if model.endswith((".pt", ".pth", ".bin")):
            state = read_checkpoint(model)
            model = convert(state, text_heads=text_heads, vision_heads=vision_heads)
            processor = processor or CLIP_H_PROCESSOR
        self.clip = ClipEmbedder(model, processor, device, dtype)

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        return self.clip.cosine(items).tolist()


class ClipScoreScorer:
    """CLIPScore (Hessel et al., 2021): ``w * max(cos, 0)``."""

    def __init__(self, model: str = "openai/clip-vit-large-patch14", processor: str | None = None,
                 w: float = 2.5, device: str = "cpu", dtype: str = "float32") -> None:
        self.clip = ClipEmbedder(model, processor, device, dtype)
        self.w = w

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        return (self.w * self.clip.cosine(items).clamp(min=0)).tolist()


class AestheticHead(nn.Module):
    """The LAION improved-aesthetic-predictor MLP; parameter names match its released state dict."""

    def __init__(self, in_dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )

    def forward(self, embeds: Tensor) -> Tensor:
        """[B, D] normalised CLIP image embeddings -> [B] scores."""
        return self.layers(embeds).squeeze(-1)


AESTHETIC_HEAD = ("https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
                  "sac+logos+ava1-l14-linearMSE.pth")
"""LAION's improved-aesthetic-predictor head for CLIP ViT-L/14 (``sac+logos+ava1-l14-linearMSE.pth``), where its
repository publishes it."""


def load_aesthetic_head(uri: str, in_dim: int) -> AestheticHead:
    """Read the head from a ``.safetensors`` or ``.pth``/``.pt`` state dict (tensors only) at a local path or an
    fsspec URI: ``https://...``, ``hf://<repo id>/<file>`` (the hub, through huggingface_hub), ``s3://...``."""
    try:
        with fsspec.open(uri, "rb") as f:
            blob = f.read()
    except (FileNotFoundError, IsADirectoryError):
        raise field_error(ConfigError, "aesthetic head", uri, "an existing file: a local path or an fsspec URI",
                          f"pass e.g. {AESTHETIC_HEAD} or hf://<repo id>/sac+logos+ava1-l14-linearMSE.pth") from None
    if uri.endswith(".safetensors"):
        from safetensors.torch import load
        state = load(blob)
    else:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    head = AestheticHead(in_dim)
    head.load_state_dict(state)
    return head.eval()


class AestheticScorer:
    """LAION aesthetic score: MLP head over CLIP ViT-L/14 image embeddings (prompt unused)."""

    def __init__(self, head: str = AESTHETIC_HEAD, model: str = "openai/clip-vit-large-patch14",
                 processor: str | None = None, device: str = "cpu", dtype: str = "float32") -> None:
        self.clip = ClipEmbedder(model, processor, device, dtype)
        dim = int(self.clip.model.config.projection_dim)
        self.head = load_aesthetic_head(head, dim).to(self.clip.device).requires_grad_(False)

    @torch.no_grad()
    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        return self.head(self.clip.images(items)).tolist()
