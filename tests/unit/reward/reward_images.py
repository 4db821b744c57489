"""Small PNG builders for reward tests."""

import io

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def to_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def text_png(text: str, size: tuple[int, int] = (320, 96)) -> bytes:
    """Black text on white, PIL's scalable default font at 32 px; empty text gives a blank image."""
    img = Image.new("RGB", size, "white")
    if text:
        ImageDraw.Draw(img).text((12, 28), text, fill="black", font=ImageFont.load_default(size=32))
    return to_png(img)


def noise_png(seed: int = 0, size: int = 128) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return to_png(Image.fromarray(arr))


def flat_png(color=(120, 30, 200), size: int = 128) -> bytes:
    return to_png(Image.new("RGB", (size, size), color))
