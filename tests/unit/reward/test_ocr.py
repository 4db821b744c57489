"""OCR reward on PIL-rendered text: exact text 1, wrong text lower, blank 0."""

import pytest
from tests.unit.reward.reward_images import text_png

from unirl_core.errors import RewardError
from unirl_core.reward import ScoreItem, build_scorer
from unirl_core.reward.scorers.ocr import edit_distance, ocr_reward, ocr_target


@pytest.fixture(scope="module")
def ocr():
    return build_scorer("ocr", num_threads=1)


def test_exact_wrong_blank(ocr):
    prompt = 'a storefront sign that says "OPEN LATE"'
    exact, wrong, blank = ocr([ScoreItem(prompt=prompt, media=text_png(t)) for t in ("OPEN LATE", "CLOSED", "")])
    assert exact == 1.0
    assert 0.0 <= wrong < exact
    assert blank == 0.0


def test_target_from_targets_wins_over_prompt(ocr):
    item = ScoreItem(prompt='sign "NOTHING"', media=text_png("HELLO"), targets={"ocr_text": "HELLO"})
    assert ocr([item]) == [1.0]


def test_reward_formula_golden():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3
    assert ocr_reward("Hello World", "helloworld") == 1.0  # spaces and case ignored
    assert ocr_reward("the HELLO sign", "hello") == 1.0  # containment scores 1
    assert ocr_reward("HELLX", "HELLO") == pytest.approx(0.8)  # 1 - 1/5
    assert ocr_reward("completely different text", "HI") == 0.0  # distance capped at len(target)


def test_missing_target_raises():
    with pytest.raises(RewardError, match="no OCR target"):
        ocr_target(ScoreItem(prompt="no quotes here"), "ocr_text")
    with pytest.raises(RewardError, match="empty"):
        ocr_reward("x", "   ")
