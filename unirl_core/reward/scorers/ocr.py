"""Text-rendering reward (Flow-GRPO's OCR task) with rapidocr's bundled PP-OCR ONNX models.

reward = 1 - min(edit_distance(recognised, target), len(target)) / len(target), on strings with
spaces removed and lower-cased; a recognised string that contains the target scores 1.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence

import numpy as np

from unirl_core.errors import RewardError
from unirl_core.reward.scorers.base import ScoreItem
from unirl_core.reward.scorers.image import decode_image

logger = logging.getLogger(__name__)
_QUOTED = re.compile(r'"([^"]+)"')


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _normalise(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_reward(recognised: str, target: str) -> float:
    """Flow-GRPO's OCR reward in [0, 1] for one image."""
    want, got = _normalise(target), _normalise(recognised)
    if not want:
        raise RewardError(f"OCR target {target!r} is empty after removing spaces; give a non-empty text")
    if want in got:
        return 1.0
    return 1.0 - min(edit_distance(got, want), len(want)) / len(want)


def ocr_target(item: ScoreItem, target_key: str) -> str:
    """``targets[target_key]`` if present, else the first double-quoted span of the prompt."""
    if target_key in item.targets:
        return item.targets[target_key]
    m = _QUOTED.search(item.prompt)
    if m is None:
        raise RewardError(f"no OCR target: targets has no {target_key!r} and the prompt {item.prompt[:80]!r} "
                          'quotes no text; write the text in double quotes, e.g. a sign saying "OPEN"')
    return m.group(1)


class OcrScorer:
    """rapidocr with fast settings: detection capped at ``det_limit_side_len``, no angle classifier."""

    def __init__(self, target_key: str = "ocr_text", det_limit_side_len: int = 640, min_text_score: float = 0.0,
                 num_threads: int = -1) -> None:
        from rapidocr import RapidOCR  # lazy: onnxruntime is only needed where OCR runs

        self.target_key = target_key
        self.min_text_score = min_text_score
        # Default detection upscales small images (~3 s each); capping the max side is 15-40x faster.
        self._engine = RapidOCR(params={
            "Det.limit_type": "max", "Det.limit_side_len": det_limit_side_len, "Global.use_cls": False,
            "Global.log_level": "warning",
            "EngineConfig.onnxruntime.intra_op_num_threads": num_threads,
            "EngineConfig.onnxruntime.inter_op_num_threads": num_threads,
        })
        self._lock = threading.Lock()  # one ORT session pair; serialise callers from server threads

    def recognise(self, item: ScoreItem) -> str:
        """All recognised text of the image, boxes joined in reading order."""
        img = np.asarray(decode_image(item))
        with self._lock:
            out = self._engine(img)
        if out.txts is None:
            return ""
        return "".join(t for t, s in zip(out.txts, out.scores) if s >= self.min_text_score)

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        return [ocr_reward(self.recognise(it), ocr_target(it, self.target_key)) for it in items]
