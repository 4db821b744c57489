"""Text rewards for AR completions: math answer correctness, format (regex), overlong penalty."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from typing import Literal

from unirl_core.errors import ConfigError, RewardError, field_error
from unirl_core.reward.scorers.base import ScoreItem

logger = logging.getLogger(__name__)


def _completion(item: ScoreItem) -> str:
    if item.text is None:
        raise RewardError("item has no text: text scorers need Part.text (the decoded completion)")
    return item.text


class _QuietTimeoutNotice(logging.Filter):
    # math-verify warns on every call that its own timeout is off; we bound time ourselves.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_QUIET = _QuietTimeoutNotice()


def _run_bounded(fn, timeout_s: float, what: str):
    """Run ``fn()`` in a daemon thread and wait at most ``timeout_s``.

    math-verify's own timeout uses ``signal.alarm``, which only works in the main thread; a
    daemon thread works anywhere (server worker threads included). A call that overruns is
    abandoned, not killed: it keeps its thread until sympy returns.
    """
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name="math-verify")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RewardError(f"{what} took longer than {timeout_s} s; raise timeout_s or shorten max_chars")
    if "error" in box:
        raise box["error"]
    return box["value"]


class MathScorer:
    """1.0 when math-verify finds the completion's answer equal to ``targets[answer_key]``, else 0.0."""

    def __init__(self, answer_key: str = "answer", timeout_s: float = 5.0, max_chars: int = 8192) -> None:
        from math_verify import parse, verify  # lazy: sympy + antlr are heavy

        self._parse, self._verify = parse, verify
        self.answer_key, self.timeout_s, self.max_chars = answer_key, timeout_s, max_chars
        for name in ("math_verify.parser", "math_verify.grader"):
            lg = logging.getLogger(name)
            if _QUIET not in lg.filters:
                lg.addFilter(_QUIET)

    def _gold(self, item: ScoreItem):
        if self.answer_key not in item.targets:
            raise RewardError(f"targets has no {self.answer_key!r} (keys: {sorted(item.targets)}); "
                              "load the reference answer into PromptRecord.targets")
        answer = item.targets[self.answer_key]
        gold = self._parse(answer, parsing_timeout=None)
        if not gold and "$" not in answer:
            gold = self._parse(f"${answer}$", parsing_timeout=None)
        if not gold:
            raise RewardError(f"math-verify cannot parse the reference answer {answer!r}")
        return gold

    def score_one(self, item: ScoreItem) -> float:
        gold = self._gold(item)
        # Keep the tail: the final answer of a long derivation sits at the end.
        text = _completion(item)[-self.max_chars:]

        def check() -> bool:
            pred = self._parse(text, parsing_timeout=None)
            return bool(pred) and bool(self._verify(gold, pred, timeout_seconds=None))

        return 1.0 if _run_bounded(check, self.timeout_s, "math-verify") else 0.0

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        return [self.score_one(it) for it in items]


class FormatScorer:
    """``reward_match`` if the completion matches ``pattern`` (DOTALL), else ``reward_miss``.

    The default pattern is the R1-style ``<think>...</think><answer>...</answer>`` layout.
    """

    def __init__(self, pattern: str = r"<think>.*?</think>\s*<answer>.*?</answer>",
                 mode: Literal["fullmatch", "search"] = "fullmatch", reward_match: float = 1.0,
                 reward_miss: float = 0.0) -> None:
        if mode not in ("fullmatch", "search"):
            raise field_error(ConfigError, "format.mode", mode, "'fullmatch' or 'search'", "pick a match mode")
        try:
            self._re = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise field_error(ConfigError, "format.pattern", pattern, "a valid regular expression", str(e)) from e
        self._match = self._re.fullmatch if mode == "fullmatch" else self._re.search
        self.reward_match, self.reward_miss = reward_match, reward_miss

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        return [self.reward_match if self._match(_completion(it).strip()) else self.reward_miss for it in items]


class LengthPenalty:
    """DAPO's overlong shaping: 0 up to ``max_length - cache``, then linear down to -1 at ``max_length``,
    -1 beyond. Length counts response tokens (``unit='tokens'``) or characters."""

    def __init__(self, max_length: int, cache: int, unit: Literal["tokens", "chars"] = "tokens") -> None:
        if not (isinstance(max_length, int) and isinstance(cache, int) and 0 < cache <= max_length):
            raise field_error(ConfigError, "length_penalty.max_length/cache", (max_length, cache),
                              "integers with 0 < cache <= max_length", "DAPO uses max_length=20480, cache=4096")
        if unit not in ("tokens", "chars"):
            raise field_error(ConfigError, "length_penalty.unit", unit, "'tokens' or 'chars'", "pick a unit")
        self.max_length, self.cache, self.unit = max_length, cache, unit

    def _length(self, item: ScoreItem) -> int:
        if self.unit == "chars":
            return len(_completion(item))
        if item.num_tokens is None:
            raise RewardError("length_penalty(unit='tokens') needs the Part's TokenSegment; use unit='chars' "
                              "for parts without one")
        return item.num_tokens

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        out = []
        for it in items:
            n, soft = self._length(it), self.max_length - self.cache
            out.append(0.0 if n <= soft else (soft - n) / self.cache if n <= self.max_length else -1.0)
        return out
