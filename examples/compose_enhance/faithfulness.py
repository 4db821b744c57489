"""``caption_recall``: how much of the caption a prompt enhancer's rewrite keeps - a faithfulness reward for audits.

The composed runs score the IMAGE against the original caption; nothing stops the enhancer from dropping words the
image model renders badly anyway (the empty prompt outscores the caption itself on shapes-sd3, see the recipes'
headers). Re-scoring a run's enhancer Parts (Part 0 of a composed Sample: prompt = the original prompt, text = the
rewrite) with this scorer shows whether its climb keeps the caption:

    python -m unirl_core.runs rescore runs/shapes-enhance --reward faith=caption_recall@0

Score: the fraction of the caption's words (``targets['caption']`` when the data set gave one, else the prompt;
lower-cased, split on non-letters, plural ``s`` kept) that occur in the rewrite; an empty rewrite scores 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from unirl_core.errors import RewardError
from unirl_core.reward.scorers.base import ScoreItem

_WORD = re.compile(r"[a-z]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class CaptionRecall:
    """Fraction of the caption's distinct words present in the item's text (the rewrite)."""

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        out = []
        for it in items:
            caption = set(words(it.targets.get("caption", it.prompt)))
            if not caption:
                raise RewardError("caption_recall: the caption (targets['caption'] or prompt) has no words")
            if it.text is None:
                raise RewardError("caption_recall scores a text Part (the enhancer's rewrite: --reward "
                                  "caption_recall@0 on a composed run); this Part has no text")
            out.append(len(caption & set(words(it.text))) / len(caption))
        return out
