"""SFT recipes parse, and bad fields fail with errors naming the field, the value and the fix."""

from __future__ import annotations

import pytest

from unirl_core.errors import ConfigError
from unirl_core.sft.config import load_sft_recipe, sft_recipe_names
from unirl_core.sft.phases import init_sft


def test_shipped_recipes_parse():
    assert {"sft-shapes", "sft-tiny-sd3", "sft-tiny-lm"} <= set(sft_recipe_names())
    for name in sft_recipe_names():
        cfg = load_sft_recipe(name)
        assert cfg.name == name and cfg.section is not None


@pytest.mark.parametrize("override, needle", [
    ("train.micro_batch_size=3", "train.micro_batch_size=3: expected a divisor of data.batch_size (8)"),
    ("train.num_updates_per_batch=2", "train.num_updates_per_batch=2"),
    ("train.old_logp_source=replay", "train.old_logp_source='replay'"),
    ("diffusion.loss.sigma_sampling=cosine", "recipe.diffusion.loss.sigma_sampling='cosine': expected one of"),
    ("diffusion.loss.caption_dropout=1.5", "diffusion.loss.caption_dropout=1.5: expected a probability in [0, 1)"),
    ("diffusion.loss.logit_std=0", "diffusion.loss.logit_std=0.0"),
    ("data.source=csv", "recipe.data.source='csv'"),
    ("data.path=null", "data.path=None: expected a .jsonl file for source='jsonl'"),
    ("data.batch_size=0", "data.batch_size=0"),
    ("loop.total_steps=0", "loop.total_steps=0: expected an integer >= 1"),
    ("loop.export_ema=true", "loop.export_ema=True: expected False unless train.ema_decay is set"),
    ("loop.typo=1", "recipe.loop.typo=1: expected a field of SFTLoopConfig"),
    ("lm.model.model=tiny", "lm='set': expected no 'lm' section for family='diffusion'"),
    ("checkpoint.every_n_steps=5", "checkpoint.every_n_steps=5: expected the default in an SFT run"),
    ("checkpoint.full_state=sharded", "checkpoint.full_state='sharded': expected the default in an SFT run"),
])
def test_bad_diffusion_fields_are_named(override, needle):
    with pytest.raises(ConfigError) as info:
        load_sft_recipe("sft-tiny-sd3", [override])
    assert needle in str(info.value)


def test_lm_rejects_the_image_source():
    with pytest.raises(ConfigError, match="data.source='shapes': expected 'jsonl' or 'calc_tool' or 'toy_arithmetic' for family='lm'"):
        load_sft_recipe("sft-tiny-lm", ["data.source=shapes"])


def test_unknown_recipe_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="sft-shapes"):
        load_sft_recipe("sft-nope")


def test_bad_records_name_the_row(tmp_path):
    bad = tmp_path / "r.jsonl"
    bad.write_text('{"prompt": "1 + 1 =", "completion": " 2"}\n{"prompt": "x"}\n')
    cfg = load_sft_recipe("sft-tiny-lm", [f"data.path={bad}", f"checkpoint.root={tmp_path}"])
    from unirl_core.sft.records import load_records

    with pytest.raises(ConfigError, match=r"r.jsonl:2.completion=None: expected a string"):
        load_records(cfg)
    missing = load_sft_recipe("sft-tiny-sd3", [f"data.path={tmp_path / 'none.jsonl'}"])
    with pytest.raises(ConfigError, match="data.path=.*none.jsonl.*expected an existing .jsonl file"):
        load_records(missing)


def test_wrong_image_size_is_named(tmp_path, image_records):
    cfg = load_sft_recipe("sft-tiny-sd3", [f"data.path={image_records}", "diffusion.height=32", "diffusion.width=32"])
    from unirl_core.sft.records import load_records

    with pytest.raises(ConfigError, match=r"record\[0\].image=\(64, 64, 3\): expected shape \(32, 32, 3\)"):
        load_records(cfg)


def test_resume_refuses_another_model(tmp_path, text_records):
    base = [f"data.path={text_records}", f"checkpoint.root={tmp_path}"]
    init_sft(load_sft_recipe("sft-tiny-lm", base))
    with pytest.raises(ConfigError, match="lm.model=.*expected .* as in .*config.json"):
        init_sft(load_sft_recipe("sft-tiny-lm", base + ["lm.model.seed=5"]))
    with pytest.raises(ConfigError, match="resume='never': expected an empty run"):
        init_sft(load_sft_recipe("sft-tiny-lm", base), resume_from="never")
