"""The cluster recipes' prompt files (``data/``): each recipe's ``data.file.path`` resolves from the project root,
passes the setup task's data check and loads enough prompts for a step; the files are in their anchor's format (a
Flow-GRPO ``.txt`` of one prompt per line, OCR prompts with a quoted target, math rows whose answers math-verify
parses); ``scripts/prepare_gsm8k.py`` converts GSM8K's rows to that format."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from unirl_core.config import load_recipe
from unirl_core.config.preflight import check_prompt_data
from unirl_core.data import PromptDataConfig, load_prompts
from unirl_core.errors import ConfigError
from unirl_core.reward.scorers.base import ScoreItem, build_scorer
from unirl_core.reward.scorers.ocr import ocr_target

REPO = Path(__file__).resolve().parents[3]
CLUSTER_RECIPES = ["sd35m-pickscore", "sd35m-ocr", "qwen3-math", "sd35m-elbo-pg"]


def _prompts(recipe: str):
    cfg = load_recipe(recipe)
    file = cfg.data.file
    return cfg, load_prompts(PromptDataConfig(path=str(REPO / file.path), prompt_field=file.prompt_field,
                                              answer_field=file.answer_field, shuffle=False))


@pytest.mark.parametrize("recipe", CLUSTER_RECIPES)
def test_the_recipes_prompt_file_resolves_from_the_project_root_and_passes_the_data_check(recipe, monkeypatch):
    monkeypatch.chdir(REPO)  # a pod's working directory is the project source's root
    cfg = load_recipe(recipe)
    assert not Path(cfg.data.file.path).is_absolute() and (REPO / cfg.data.file.path).is_file()
    check_prompt_data(cfg)
    _, ds = _prompts(recipe)
    assert len(ds) >= cfg.data.prompts_per_step
    assert len({r.prompt for r in ds.records}) == len(ds)  # no duplicate prompt


def test_ocr_prompts_each_carry_a_quoted_target():
    _, ds = _prompts("sd35m-ocr")
    targets = [ocr_target(ScoreItem(prompt=r.prompt, targets=dict(r.targets)), "ocr_text") for r in ds.records]
    assert all(t and t == t.strip() for t in targets), targets


def test_math_answers_are_what_math_verify_scores_a_right_boxed_answer_against():
    _, ds = _prompts("qwen3-math")
    scorer = build_scorer("math")
    items = [ScoreItem(prompt=r.prompt, text=f"... so the answer is \\boxed{{{r.targets['answer']}}}",
                       targets=dict(r.targets)) for r in ds.records]
    assert scorer(items) == [1.0] * len(items)
    wrong = [ScoreItem(prompt=it.prompt, text=f"\\boxed{{{int(it.targets['answer']) + 1}}}", targets=it.targets)
             for it in items]
    assert scorer(wrong) == [0.0] * len(items)


def test_a_txt_prompt_set_is_one_prompt_per_line_in_the_prompt_column(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("a cat\n\n  a dog on a sofa  \r\na \"quoted\" sign\n")
    ds = load_prompts(PromptDataConfig(path=str(path), answer_field=None, shuffle=False))
    assert [r.prompt for r in ds.records] == ["a cat", "a dog on a sofa", 'a "quoted" sign']
    cfg = load_recipe("tiny-grpo", ["data.source=file", f"data.file={{path: '{path}', prompt_field: caption, "
                                                     "answer_field: null}", "data.prompts_per_step=2"])
    with pytest.raises(ConfigError, match=r"^data.file.prompt_field='caption'.*columns \['prompt'\]"):
        check_prompt_data(cfg)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe not utf-8\n")
    with pytest.raises(ConfigError, match=r"bad\.txt.*not UTF-8"):
        load_prompts(PromptDataConfig(path=str(tmp_path / "bad.txt"), answer_field=None))


def _prepare_gsm8k():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", REPO / "scripts" / "prepare_gsm8k.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prepare_gsm8k_keeps_the_final_value_of_a_worked_solution():
    mod = _prepare_gsm8k()
    row = {"question": " Ann has 3 boxes of 400 pens. How many pens? ",
           "answer": "3 boxes of 400 is 3 * 400 = <<3*400=1200>>1200 pens.\n#### 1,200"}
    assert mod.convert_row(row) == {"question": "Ann has 3 boxes of 400 pens. How many pens?", "answer": "1200"}
    with pytest.raises(ValueError, match="####"):
        mod.convert_row({"question": "q", "answer": "no final mark"})
