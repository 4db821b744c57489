"""The scorer contract, the name registry, and the one place scorer calls are run and checked.

A scorer is any callable ``(items: Sequence[ScoreItem]) -> Sequence[float]`` with one value per
item. It may raise or return non-finite values; ``run_scorer`` turns both into per-item errors
that the RewardService's failure policy then handles. Registry entries are ``module:attr``
strings so that listing or validating names never imports transformers or rapidocr.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from unirl_core.errors import ConfigError, RewardError, field_error
from unirl_core.plugins import discover
from unirl_core.types import Part

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ScoreItem:
    """What a scorer sees of one generated Part (and all that travels to a remote server)."""

    prompt: str = ""
    """The prompt text."""
    text: str | None = None
    """The AR completion, if any."""
    media: bytes | None = None
    """The decoded image as PNG bytes, if any."""
    targets: dict[str, str] = field(default_factory=dict)
    """Reference data, e.g. ``{"answer": "42"}`` or ``{"ocr_text": "HELLO"}``."""
    num_tokens: int | None = None
    """Number of response tokens of an AR Part (for length shaping); None when unknown."""

    @classmethod
    def from_part(cls, part: Part) -> ScoreItem:
        seg = part.segment
        n = seg.num_response_tokens if seg is not None and hasattr(seg, "num_response_tokens") else None
        return cls(prompt=part.prompt, text=part.text, media=part.media, targets=dict(part.targets), num_tokens=n)


@runtime_checkable
class Scorer(Protocol):
    """Scores a list of items; one float per item, in order."""

    def __call__(self, items: Sequence[ScoreItem]) -> Sequence[float]: ...


_REGISTRY: dict[str, str | Callable[..., Scorer]] = {
    "jpeg_compressibility": "unirl_core.reward.scorers.image:JpegCompressibility",
    "jpeg_incompressibility": "unirl_core.reward.scorers.image:JpegIncompressibility",
    "ocr": "unirl_core.reward.scorers.ocr:OcrScorer",
    "pickscore": "unirl_core.reward.scorers.clip:PickScoreScorer",
    "hpsv2": "unirl_core.reward.scorers.clip:HPSv2Scorer",
    "clip_score": "unirl_core.reward.scorers.clip:ClipScoreScorer",
    "aesthetic": "unirl_core.reward.scorers.clip:AestheticScorer",
    "image_reward": "unirl_core.reward.scorers.image_reward:ImageRewardScorer",
    "math": "unirl_core.reward.scorers.text:MathScorer",
    "format": "unirl_core.reward.scorers.text:FormatScorer",
    "length_penalty": "unirl_core.reward.scorers.text:LengthPenalty",
    "toy_arithmetic": "unirl_core.data.toy:ToyArithmeticScorer",
    "agent_return": "unirl_core.env.reward:AgentReturnScorer",
}


def register_scorer(name: str, factory: str | Callable[..., Scorer], *, replace: bool = False) -> None:
    """Register ``factory`` (a callable or a ``"module:attr"`` string) under ``name``."""
    if not isinstance(name, str) or not name:
        raise field_error(ConfigError, "scorer name", name, "a non-empty string", "name the scorer")
    if name in _REGISTRY and not replace:
        raise field_error(ConfigError, "scorer name", name, "a name not yet registered",
                          "pick another name or pass replace=True")
    _REGISTRY[name] = factory


def scorer_names() -> list[str]:
    """The registered names, the plugins' (``unirl_core.plugins``) included."""
    discover()
    return sorted(_REGISTRY)


def build_scorer(name: str, **kwargs) -> Scorer:
    """Instantiate the scorer registered as ``name`` with ``kwargs`` (this may load a model)."""
    if name not in _REGISTRY:
        discover()
    if name not in _REGISTRY:
        raise field_error(ConfigError, "reward component name", name, f"one of {scorer_names()}",
                          "register custom scorers with unirl_core.reward.register_scorer")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise field_error(ConfigError, f"reward component {name!r} kwargs", kwargs,
                          f"arguments accepted by {getattr(factory, '__name__', factory)}", str(e)) from e
    return factory(**kwargs)


@dataclass(kw_only=True)
class ComponentScores:
    """One component's result over a list of items: a value and an error (or None) per item."""

    values: list[float]
    errors: list[str | None]

    def failed(self, i: int) -> bool:
        return self.errors[i] is not None or not math.isfinite(self.values[i])


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class ScorerContractError(RewardError):
    """A scorer broke its contract (wrong number of values): a bug, never isolated per item."""


def _call(scorer: Scorer, items: Sequence[ScoreItem], name: str) -> list[float]:
    out = list(scorer(items))
    if len(out) != len(items):
        raise ScorerContractError(f"scorer {name!r} returned {len(out)} values for {len(items)} items; "
                                  "a scorer must return exactly one value per item")
    return [float(v) for v in out]


def run_scorer(scorer: Scorer, items: Sequence[ScoreItem], *, name: str, isolate: bool) -> ComponentScores:
    """Run ``scorer`` on ``items`` and record failures per item instead of raising.

    If the whole call raises and ``isolate`` is True, each item is retried alone so one bad
    item does not fail its neighbours; with ``isolate`` False every item gets the error.
    Non-finite values are kept as they are; ``ComponentScores.failed`` flags them. A wrong
    number of values raises ScorerContractError.
    """
    try:
        return ComponentScores(values=_call(scorer, items, name), errors=[None] * len(items))
    except ScorerContractError:
        raise
    except Exception as e:  # noqa: BLE001 - any scorer failure becomes a per-item error for the policy
        logger.warning("scorer %r failed on %d items: %s", name, len(items), _describe(e))
        if not isolate or len(items) == 1:
            return ComponentScores(values=[math.nan] * len(items), errors=[_describe(e)] * len(items))
    values: list[float] = []
    errors: list[str | None] = []
    for item in items:
        try:
            values.append(_call(scorer, [item], name)[0])
            errors.append(None)
        except ScorerContractError:
            raise
        except Exception as e:  # noqa: BLE001
            values.append(math.nan)
            errors.append(_describe(e))
    return ComponentScores(values=values, errors=errors)
