"""The enhancer's supervised warm start: which pairs it trains on, and that it teaches what they say."""

from __future__ import annotations

import collections

import pytest

from unirl_core.compose.config import WarmStartConfig, load_compose_recipe, stack_configs
from unirl_core.compose.warm_start import warm_pairs, warm_start_enhancer
from unirl_core.errors import ConfigError
from unirl_core.runtime import build
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.types import PromptRecord, SampleBatch

COLOURS = ("red", "green", "blue", "yellow")


def test_pairs_copy_the_prompt_or_add_each_colour_once():
    recs = [PromptRecord(prompt_id="a", prompt="two circles"), PromptRecord(prompt_id="b", prompt="a square")]
    assert warm_pairs(recs, WarmStartConfig(pairs="copy")) == [("two circles", "two circles"),
                                                             ("a square", "a square")]
    pairs = warm_pairs(recs, WarmStartConfig(pairs="add_colour", colours=("red", "blue")))
    assert pairs == [("two circles", "two red circles"), ("two circles", "two blue circles"),
                     ("a square", "a red square"), ("a square", "a blue square")]


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"pairs": "paraphrase"}, "enhancer.warm_start.pairs='paraphrase'"),
    ({"pairs": "add_colour", "colours": ("red", "teal")}, "enhancer.warm_start.colours=['red', 'teal']"),
    ({"pairs": "add_colour", "colours": ()}, "enhancer.warm_start.colours=[]"),
])
def test_bad_warm_start_values_name_the_field(kwargs, names):
    with pytest.raises(ConfigError) as info:
        WarmStartConfig(**kwargs)
    assert names in str(info.value)


def test_add_colour_needs_prompts_with_their_colour_left_out(tmp_path):
    with pytest.raises(ConfigError, match=r"enhancer.warm_start.pairs='add_colour'.*data.shapes.omit: \[colour\]"):
        load_compose_recipe("shapes-enhance-colour", [f"checkpoint.root={tmp_path}", "data.shapes.omit=[]"])
    assert load_compose_recipe("shapes-enhance-colour", ["data.shapes.omit=[]", "enhancer.warm_start.pairs=copy"])


def test_shipped_colour_recipe_warm_start_adds_a_colour_without_preferring_one(tmp_path):
    """The add_colour warm start of shapes-enhance-colour, as shipped: sampled at the recipe's temperature, the
    enhancer writes the prompt with one colour added (no copies, no empty rewrites) and no colour dominates - which
    one the reward wants is left for RL to find."""
    cfg = load_compose_recipe("shapes-enhance-colour", [f"checkpoint.root={tmp_path}"])
    assert (cfg.enhancer.warm_start.pairs, cfg.enhancer.warm_start.colours) == ("add_colour", COLOURS)
    sub = stack_configs(cfg)["enhancer"]
    bundle = build.fresh_bundle(sub)
    records = build.dataset(sub).records
    losses = warm_start_enhancer(bundle, records, cfg.enhancer.warm_start, sub.lm.engine)
    assert len(losses) == cfg.enhancer.warm_start.steps and losses[-1] < losses[0] / 3
    distinct = list({r.prompt: r for r in records}.values())
    out = TrainsideAREngine(bundle, sub.lm.engine).generate(
        SampleBatch.from_prompts(distinct, samples_per_prompt=16, kind="ar", sampling=sub.lm.sampling))
    texts = [(s.generated.prompt, (s.generated.text or "").strip()) for s in out.samples]
    added = collections.Counter(next((c for c in COLOURS if t == _with(p, c)), None) for p, t in texts)
    n = len(texts)
    assert added[None] / n < 0.25, added  # most rewrites are the prompt with one colour added
    assert all(0.1 < added[c] / n < 0.45 for c in COLOURS), added
    assert not any(t == p or t == "" for p, t in texts)


def _with(prompt: str, colour: str) -> str:
    from examples.shapes.data import with_colour

    return with_colour(prompt, colour)
