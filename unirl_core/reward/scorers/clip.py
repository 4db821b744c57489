"""CLIP-family preference scorers: PickScore, HPS-v2, CLIP score, LAION aesthetic.

All load a transformers ``CLIPModel`` and a processor with ``from_pretrained`` (a local
directory or a hub id); the aesthetic head is a small MLP read from a local file. Scores use
L2-normalised projected embeddings:

- PickScore: ``logit_scale.exp() * cos(image, prompt) / divisor`` (Flow-GRPO divides by 26);
- HPS-v2:    ``cos(image, prompt)`` of the HPS-tuned CLIP (weights converted to transformers format);
- CLIP score: ``w * max(cos(image, prompt), 0)`` with ``w = 2.5`` (Hessel et al., 2021);
- aesthetic: ``MLP(normalised image embedding)``, LAION's improved-aesthetic-predictor head.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from unirl_core.errors import ConfigError, field_error
from unirl_core.reward.scorers.base import ScoreItem
from unirl_core.reward.scorers.image import decode_image

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _features(out) -> Tensor:
    # transformers < 5 returns the projected tensor; 5.x wraps it in an output's pooler_output.
    return out if isinstance(out, Tensor) else out.pooler_output


def _normalise(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)


class ClipEmbedder:
    """A CLIP model + processor pair that embeds images and prompts ([B, D] normalised, fp32)."""

    def __init__(self, model: str, processor: str | None = None, device: str = "cpu", dtype: str = "float32",
                 max_batch: int = 16) -> None:
        from transformers import AutoProcessor, CLIPModel  # lazy: keep `import unirl_core.reward` light

        if dtype not in _DTYPES:
            raise field_error(ConfigError, "clip scorer dtype", dtype, f"one of {sorted(_DTYPES)}",
                              "use float32 on CPU, bfloat16 / float16 on GPU")
        self.device = torch.device(device)
        self.model = CLIPModel.from_pretrained(model, dtype=_DTYPES[dtype]).to(self.device).eval().requires_grad_(False)
        self.processor = AutoProcessor.from_pretrained(processor or model)
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
    """HPS-v2 (Wu et al., 2023). The official checkpoint is open_clip format: convert it to a
    transformers CLIP-H directory first (see the package README)."""

    def __init__(self, model: str, processor: str | None = None, device: str = "cpu", dtype: str = "float32") -> None:
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


def load_aesthetic_head(path: str, in_dim: int) -> AestheticHead:
    """Read the head from a ``.safetensors`` or ``.pth``/``.pt`` state dict (tensors only)."""
    p = Path(path)
    if not p.is_file():
        raise field_error(ConfigError, "aesthetic head", path, "an existing local file",
                          "download LAION's sac+logos+ava1-l14-linearMSE.pth and pass its path")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(p))
    else:
        state = torch.load(str(p), map_location="cpu", weights_only=True)
    head = AestheticHead(in_dim)
    head.load_state_dict(state)
    return head.eval()


class AestheticScorer:
    """LAION aesthetic score: MLP head over CLIP ViT-L/14 image embeddings (prompt unused)."""

    def __init__(self, head: str, model: str = "openai/clip-vit-large-patch14", processor: str | None = None,
                 device: str = "cpu", dtype: str = "float32") -> None:
        self.clip = ClipEmbedder(model, processor, device, dtype)
        dim = int(self.clip.model.config.projection_dim)
        self.head = load_aesthetic_head(head, dim).to(self.clip.device).requires_grad_(False)

    @torch.no_grad()
    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        return self.head(self.clip.images(items)).tolist()
