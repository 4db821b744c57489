"""Image decoding shared by image scorers, and DDPO's JPEG (in)compressibility rewards."""

from __future__ import annotations

import io
from collections.abc import Sequence

from PIL import Image

from unirl_core.errors import RewardError
from unirl_core.reward.scorers.base import ScoreItem


def decode_image(item: ScoreItem) -> Image.Image:
    """The item's media as an RGB PIL image; raises RewardError when there is none or it is not an image."""
    if not item.media:
        raise RewardError("item has no media: image scorers need Part.media (PNG bytes) filled by the rollout")
    try:
        img = Image.open(io.BytesIO(item.media))
        img.load()
    except Exception as e:  # noqa: BLE001 - PIL raises several unrelated types for bad bytes
        raise RewardError(f"media is not a decodable image ({len(item.media)} bytes): {e}") from e
    return img.convert("RGB")


def jpeg_size_kb(img: Image.Image, quality: int) -> float:
    """Size in kB (1000 bytes) of ``img`` encoded as JPEG at ``quality``."""
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


class JpegIncompressibility:
    """DDPO's ``jpeg_incompressibility``: the JPEG size in kB at quality 95 (detail scores high)."""

    def __init__(self, quality: int = 95) -> None:
        if not (isinstance(quality, int) and 1 <= quality <= 100):
            raise RewardError(f"quality={quality!r}: expected an integer in [1, 100]; DDPO uses 95")
        self.quality = quality

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        return [jpeg_size_kb(decode_image(it), self.quality) for it in items]


class JpegCompressibility(JpegIncompressibility):
    """DDPO's ``jpeg_compressibility``: minus the JPEG size in kB at quality 95, divided by 500."""

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        return [-size / 500.0 for size in super().__call__(items)]
