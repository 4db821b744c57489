"""Multi-turn SFT records: the agentic engine's token layout, environment turns masked out of the loss."""

import json

import pytest
import torch

from examples.agentic.calculator import CalculatorEnvConfig
from unirl_core.errors import ConfigError
from unirl_core.models.lm import build_tiny_lm
from unirl_core.rollout.agentic import AgentConfig, AgenticEngine
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.sft.config import load_sft_recipe
from unirl_core.sft.records import read_jsonl, supervised_batch


def test_turn_records_become_masked_segments(tmp_path):
    path = tmp_path / "conv.jsonl"
    rows = [{"prompt": "12 * 3 =", "turns": [{"role": "assistant", "content": "[12*3]"},
                                             {"role": "env", "content": "36"}, {"role": "assistant", "content": "36"}]},
            {"prompt": "2 + 2 =", "completion": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_sft_recipe("sft-tiny-lm", [f"data.path={path}", "data.batch_size=2", "train.micro_batch_size=2"])
    records = read_jsonl(cfg)
    assert records[0].turns is not None and records[1].turns is None
    bundle = build_tiny_lm(seed=0)
    engine = TrainsideAREngine(bundle)
    batch = supervised_batch(cfg, records, 1, policy_version=0, encode_prompt=engine.encode_prompt,
                             tokenizer=bundle.tokenizer, eos_id=bundle.tokenizer.eos_token_id)
    seg = next(p.segment for p in batch.generated if p.prompt == "12 * 3 =")
    tok, eos = bundle.tokenizer, bundle.tokenizer.eos_token_id
    call = tok("[12*3]", add_special_tokens=False)["input_ids"] + [eos]
    obs = AgenticEngine(engine, AgentConfig(env=CalculatorEnvConfig()))._encode_observation("36").tolist()  # what a rollout appends
    answer = tok("36", add_special_tokens=False)["input_ids"] + [eos]
    assert seg.response_ids.tolist() == call + obs + answer
    assert seg.response_mask.tolist() == [True] * len(call) + [False] * len(obs) + [True] * len(answer)
    assert torch.equal(seg.prompt_ids, engine.encode_prompt("12 * 3 ="))


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x", "turns": []}, r"turns=\[\]: expected a non-empty list"),
    ({"prompt": "x", "turns": [{"role": "tool", "content": "1"}]}, r"expected a non-empty list of \{role"),
    ({"prompt": "x"}, r"completion=None: expected a string"),
])
def test_bad_turn_records_name_the_row(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    cfg = load_sft_recipe("sft-tiny-lm", [f"data.path={path}"])
    with pytest.raises(ConfigError, match=message):
        read_jsonl(cfg)
