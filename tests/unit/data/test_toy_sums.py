"""The toy-sums pieces: the exact-match scorer and the SFT warm-start records of the toy task."""

import pytest

from examples.toy_sums.reward import toy_correct
from unirl_core.data.toy import ToyArithmeticConfig, toy_arithmetic_prompts
from unirl_core.errors import ConfigError
from unirl_core.reward.scorers.base import ScoreItem, build_scorer
from unirl_core.sft.config import load_sft_recipe
from unirl_core.sft.records import TextRecord, load_records


def test_toy_correct_is_exact_match():
    assert toy_correct(" 12", "12") == 1.0 and toy_correct("012", "12") == 1.0  # integers compare
    assert toy_correct("13", "12") == 0.0 and toy_correct("12a", "12") == 0.0 and toy_correct("", "0") == 0.0
    scorer = build_scorer("toy_correct")
    items = [ScoreItem(prompt="3 + 4 =", text="7", targets={"answer": "7"}),
             ScoreItem(prompt="3 + 4 =", text="77", targets={"answer": "7"})]
    assert scorer(items) == [1.0, 0.0]
    assert build_scorer("toy_arithmetic")(items) == [1.0, 0.5]  # the blended reward: half format, half correct
    with pytest.raises(ConfigError, match="answer"):
        scorer([ScoreItem(prompt="3 + 4 =", text="7", targets={})])


def test_sft_toy_records_are_the_rl_prompts_with_their_sums():
    cfg = load_sft_recipe("sft-toy-sums")
    recs = load_records(cfg)
    prompts = toy_arithmetic_prompts(ToyArithmeticConfig(num_prompts=64, max_operand=9, seed=0))
    assert recs == [TextRecord(p.prompt, p.targets["answer"]) for p in prompts]
    with pytest.raises(ConfigError, match="data.source"):
        load_sft_recipe("sft-toy-sums", ["data.source=parquet"])
