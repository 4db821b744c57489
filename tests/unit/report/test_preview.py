"""Thumbnails in decks and reports: small PNGs embedded as they are, anything else a JPEG thumbnail."""

import base64
import io

import numpy as np
from PIL import Image

from unirl_core.report.preview import EMBED_MAX_BYTES, THUMB_PX, png_size, thumbnail_data_uri


def _encode(a: np.ndarray, fmt: str) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a).save(b, format=fmt)
    return b.getvalue()


def _decode(uri: str) -> tuple[str, Image.Image]:
    head, data = uri.split(",", 1)
    return head, Image.open(io.BytesIO(base64.b64decode(data)))


def test_small_png_is_embedded_bit_for_bit():
    a = np.zeros((64, 48, 3), dtype=np.uint8)  # flat colours, as the shapes world renders them
    a[10:30, 5:25] = (200, 30, 30)
    a[40:60, 20:44] = (20, 40, 220)
    png = _encode(a, "PNG")
    assert png_size(png) == (48, 64) and len(png) <= EMBED_MAX_BYTES
    head, im = _decode(thumbnail_data_uri(png))
    assert head == "data:image/png;base64"
    assert base64.b64decode(thumbnail_data_uri(png).split(",", 1)[1]) == png
    assert np.array_equal(np.asarray(im), a)


def test_large_or_heavy_images_become_jpeg_thumbnails():
    rng = np.random.default_rng(1)
    big = _encode(rng.integers(0, 256, (256, 200, 3), dtype=np.uint8), "PNG")  # larger than the thumbnail
    heavy = _encode(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "PNG")  # fits, but noisy: over the byte cap
    assert len(heavy) > EMBED_MAX_BYTES
    jpeg_in = _encode(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "JPEG")  # not a PNG: never embedded
    for data, size in ((big, THUMB_PX), (heavy, THUMB_PX), (jpeg_in, THUMB_PX), (big, 64)):
        head, im = _decode(thumbnail_data_uri(data, size))
        assert head == "data:image/jpeg;base64" and max(im.size) <= size
    assert _decode(thumbnail_data_uri(big))[1].size == (75, 96)  # 200 x 256, aspect kept


def test_png_size_rejects_what_is_not_a_png_header():
    png = _encode(np.zeros((4, 5, 3), dtype=np.uint8), "PNG")
    assert png_size(png) == (5, 4)
    assert png_size(png[:20]) is None and png_size(b"GIF89a" + png[6:]) is None and png_size(b"") is None


def test_jpeg_thumbnails_are_reused_by_content_and_size_and_the_cache_is_bounded(monkeypatch):
    from unirl_core.report import preview

    rng = np.random.default_rng(2)
    imgs = [_encode(rng.integers(0, 256, (128, 128, 3), dtype=np.uint8), "PNG") for _ in range(3)]
    made = []
    real = preview._jpeg_thumbnail
    monkeypatch.setattr(preview, "_jpeg_thumbnail", lambda png, size: made.append(size) or real(png, size))
    monkeypatch.setattr(preview, "_THUMBS", preview.OrderedDict())
    monkeypatch.setattr(preview, "THUMB_CACHE_ENTRIES", 2)
    first = thumbnail_data_uri(imgs[0])
    assert thumbnail_data_uri(bytes(imgs[0])) == first == real(imgs[0], THUMB_PX)  # equal bytes: made once
    assert len(made) == 1
    thumbnail_data_uri(imgs[0], 64)  # another size is another thumbnail
    assert made == [THUMB_PX, 64]
    thumbnail_data_uri(imgs[1])
    thumbnail_data_uri(imgs[2])
    assert len(preview._THUMBS) == 2  # the oldest entries went
    thumbnail_data_uri(imgs[0])
    assert len(made) == 5
