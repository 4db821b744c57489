"""The toy-sums reward: exact-match correctness of the toy arithmetic task (``toy_correct``)."""

from __future__ import annotations

from unirl_core.data.toy import ToyArithmeticScorer


def toy_correct(completion: str, answer: str) -> float:
    """Exact match: 1.0 when the stripped completion is the answer's integer in decimal digits, else 0.0."""
    text = completion.strip()
    return float(text.isdigit() and int(text) == int(answer))


class ToyCorrectScorer(ToyArithmeticScorer):
    """Reward-registry scorer (name ``toy_correct``): ``toy_correct`` exact match per ScoreItem. Its mean is the
    task's accuracy; as the only weighted component it is GRPO on correctness alone."""

    score = staticmethod(toy_correct)
