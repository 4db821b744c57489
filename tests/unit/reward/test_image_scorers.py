"""DDPO's JPEG rewards order a flat image and noise correctly."""

import pytest
from tests.unit.reward.reward_images import flat_png, noise_png

from unirl_core.errors import RewardError
from unirl_core.reward import ScoreItem, build_scorer


def test_jpeg_orders_flat_vs_noise():
    items = [ScoreItem(media=flat_png()), ScoreItem(media=noise_png())]
    flat_size, noise_size = build_scorer("jpeg_incompressibility")(items)
    assert noise_size > 10 * flat_size > 0  # noise barely compresses, a flat colour almost vanishes
    flat_c, noise_c = build_scorer("jpeg_compressibility")(items)
    assert flat_c > noise_c
    assert (flat_c, noise_c) == pytest.approx((-flat_size / 500, -noise_size / 500))


def test_jpeg_needs_decodable_media():
    with pytest.raises(RewardError, match="no media"):
        build_scorer("jpeg_compressibility")([ScoreItem(prompt="x")])
    with pytest.raises(RewardError, match="not a decodable image"):
        build_scorer("jpeg_compressibility")([ScoreItem(media=b"not a png")])
    with pytest.raises(RewardError, match="quality"):
        build_scorer("jpeg_compressibility", quality=0)
