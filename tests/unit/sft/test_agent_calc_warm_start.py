"""tiny-agent-calc's shipped warm start: sft-agent-calc trains the RL recipe's own model on the RL task's prompts
in the tool-call format, and the RL recipe refuses to start without its export, naming the SFT command."""

import pytest

from examples.agentic.sft import calc_records
from unirl_core.config.preflight import preflight
from unirl_core.config.recipes import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.sft.config import load_sft_recipe
from unirl_core.sft.records import load_records


def test_the_warm_start_matches_the_rl_recipe():
    rl, sft = load_recipe("tiny-agent-calc"), load_sft_recipe("sft-agent-calc")
    assert rl.lm.model.model == f"runs/{sft.name}/export" and sft.checkpoint.root == "runs"
    assert sft.lm.model.model == "tiny" and sft.lm.model.tiny == rl.lm.model.tiny
    assert sft.lm.model.seed == rl.lm.model.seed and sft.lm.model.dtype == rl.lm.model.dtype
    assert sft.data.section("calc").rl_recipe == rl.name  # its prompts and tool tags are read from it


def test_records_call_the_tool_on_a_fraction_of_the_prompts():
    sft = load_sft_recipe("sft-agent-calc")
    records = load_records(sft)
    rl = load_recipe("tiny-agent-calc")
    assert len(records) == rl.data.section("toy").num_prompts == 2000 and records == calc_records(sft)
    calls = [r for r in records if len(r.turns) == 3]
    assert 0.25 < len(calls) / len(records) < 0.35  # tool_frac 0.3 of 2000 independent draws
    rec = calls[0]
    a, b = rec.prompt.rstrip(" =").split(" * ")
    product = str(int(a) * int(b))
    assert rec.turns == (("assistant", f"[{a}*{b}]"), ("env", product), ("assistant", product))
    direct = next(r for r in records if len(r.turns) == 1)
    a, b = direct.prompt.rstrip(" =").split(" * ")
    assert direct.turns == (("assistant", str(int(a) * int(b))),) and direct.completion == str(int(a) * int(b))
    none = load_sft_recipe("sft-agent-calc", ["data.calc.tool_frac=0"])
    assert all(len(r.turns) == 1 for r in load_records(none))


def test_a_bad_tool_fraction_or_rl_recipe_names_the_field():
    with pytest.raises(ConfigError, match=r"calc\.tool_frac=1\.5.*\[0, 1\]"):
        load_sft_recipe("sft-agent-calc", ["data.calc.tool_frac=1.5"])
    with pytest.raises(ConfigError, match=r"data\.calc\.rl_recipe='tiny-grpo'.*calculator agent"):
        load_records(load_sft_recipe("sft-agent-calc", ["data.calc.rl_recipe=tiny-grpo"]))


def test_without_its_warm_start_the_rl_recipe_names_the_sft_command(tmp_path):
    cfg = load_recipe("tiny-agent-calc", [f"checkpoint.root={tmp_path}",
                                          f"lm.model.model={tmp_path}/sft-agent-calc/export"])
    with pytest.raises(ConfigError, match=r"lm\.model\.model=.*export of SFT run 'sft-agent-calc'.*"
                                          r"python -m unirl_core\.sft --recipe sft-agent-calc"):
        preflight(cfg, timeout=30)
