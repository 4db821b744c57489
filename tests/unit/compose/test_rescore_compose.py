"""Re-scoring a composed run: its batches are kept (checkpoint.keep_batches), its plugins are found through its
stacks, and the enhancer's rewrites (Part 0) score under the faithfulness reward caption_recall exactly as computed
by hand from the stored rewrites."""

from __future__ import annotations

import pytest

from examples.compose_enhance.faithfulness import CaptionRecall, words
from tests.unit.compose.conftest import small_config
from unirl_core.checkpoint.batches import BatchStore
from unirl_core.compose.local import run_compose_local
from unirl_core.errors import ConfigError
from unirl_core.runs.rescore import parse_reward_arg, rescore
from unirl_core.reward.scorers.base import ScoreItem


def test_caption_recall_by_hand():
    score = CaptionRecall()
    items = [ScoreItem(prompt="two circles", text="two blue circles", media=None, targets={"caption": "two blue circles"},
                       num_tokens=None),
             ScoreItem(prompt="two circles", text="", media=None, targets={"caption": "two blue circles"},
                       num_tokens=None),
             ScoreItem(prompt="a red square", text="red, a square!", media=None, targets={}, num_tokens=None),
             ScoreItem(prompt="a red square", text="blue triangle", media=None, targets={}, num_tokens=None)]
    assert score(items) == [1.0, 0.0, 1.0, 0.0]
    assert score([ScoreItem(prompt="two circles", text="two", media=None, targets={}, num_tokens=None)]) == [0.5]


@pytest.mark.slow
def test_rescore_composed_run_with_caption_recall_on_the_rewrites(tmp_path):
    cfg = small_config(tmp_path, "image.frozen=true", "checkpoint.keep_batches=true")
    run_compose_local(cfg, resume_from="never", progress=False)
    run = f"{tmp_path}/{cfg.name}"
    table = rescore(run, [parse_reward_arg("faith=caption_recall@0")])
    batches = BatchStore(str(tmp_path), cfg.name)
    assert [r.step for r in table.rows] == batches.steps() == [1, 2]
    for row in table.rows:
        batch = batches.load(row.step)
        hand = []
        for s in batch.samples:
            ar = s.parts[0]
            caption = set(words(ar.targets.get("caption", ar.prompt)))
            hand.append(len(caption & set(words(ar.text))) / len(caption))
        assert row.means["faith"] == pytest.approx(sum(hand) / len(hand), abs=1e-12)
        stored = [s.generated.reward for s in batch.samples]
        assert row.run == pytest.approx(sum(stored) / len(stored), abs=1e-12)
    with pytest.raises(ConfigError, match="a Part index"):
        rescore(run, [parse_reward_arg("faith=caption_recall@5")], write=False)
