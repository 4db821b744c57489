"""The CPU rehearsal's overrides (``unirl_core/config/rehearsal.py``) change only what they document: the model (same
family, random init, CPU), the shapes, the CLIP scorers' weights folder, the storage root and the step count; the
algorithm, loss, data path, reward components, advantage, tracker, checkpoint policy and report stay the recipe's."""

from __future__ import annotations

import json

import pytest

from unirl_core.config import load_recipe
from unirl_core.config.loader import to_dict
from unirl_core.config.rehearsal import main, rehearsal_overrides
from unirl_core.errors import ConfigError

CHANGED = {
    "diffusion": {"checkpoint.root", "loop.total_steps", "loop.rollout_shards", "data.prompts_per_step",
                  "data.samples_per_prompt", "train.micro_batch_size", "diffusion.model.source",
                  "diffusion.model.dtype", "diffusion.model.device", "diffusion.model.cuda_graphs",
                  "diffusion.engine.forward_batch_size", "diffusion.sampling.height", "diffusion.sampling.width",
                  "reward.components"},
    "lm": {"checkpoint.root", "loop.total_steps", "loop.rollout_shards", "data.prompts_per_step",
           "data.samples_per_prompt", "train.micro_batch_size", "lm.model.model", "lm.model.tokenizer",
           "lm.model.dtype", "lm.model.device", "lm.engine.forward_batch_size", "lm.sampling.max_new_tokens",
           "lm.algorithm.max_response_tokens"},
}


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "kwargs":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("recipe", ["sd35m-pickscore", "sd35m-ocr", "qwen3-math"])
def test_the_rehearsal_changes_only_what_it_documents(recipe, tmp_path):
    shipped = _flat(to_dict(load_recipe(recipe)))
    rehearsal = load_recipe(recipe, rehearsal_overrides(recipe, str(tmp_path)))
    got = _flat(to_dict(rehearsal))
    changed = {k for k in shipped.keys() | got.keys() if shipped.get(k) != got.get(k)}
    allowed = CHANGED[rehearsal.family]
    assert changed <= allowed | {k for k in changed if k.startswith("reward.components")}, sorted(changed - allowed)
    assert rehearsal.data.file.path == load_recipe(recipe).data.file.path
    comps = [(c.name, c.weight) for c in rehearsal.reward.components]
    assert comps == [(c.name, c.weight) for c in load_recipe(recipe).reward.components]


def test_clip_scorers_read_the_tiny_clip_folder_with_the_recipes_other_kwargs(tmp_path):
    cfg = load_recipe("sd35m-pickscore", rehearsal_overrides("sd35m-pickscore", str(tmp_path)))
    (pick,) = cfg.reward.components
    clip = str(tmp_path / "rehearsal-clip")
    assert pick.kwargs == {"model": clip, "processor": clip, "divisor": 26.0, "device": "cpu", "dtype": "float32"}
    assert (tmp_path / "rehearsal-clip" / "config.json").is_file()


def test_the_stand_in_has_the_recipes_architecture_and_an_unknown_model_is_refused(tmp_path):
    cfg = load_recipe("sd35m-pickscore", rehearsal_overrides("sd35m-pickscore", str(tmp_path)))
    assert cfg.diffusion.model.source == "tiny-sd35"
    assert load_recipe("qwen3-math", rehearsal_overrides("qwen3-math", str(tmp_path))).lm.model.model == "tiny"
    other = tmp_path / "flux.yaml"
    other.write_text("name: f\nfamily: diffusion\ndiffusion: {model: {source: black-forest-labs/FLUX.1-dev}}\n")
    with pytest.raises(ConfigError, match=r"^diffusion.model.source='black-forest-labs/FLUX.1-dev'.*RANDOM_INIT"):
        rehearsal_overrides(str(other), str(tmp_path))


def test_the_cli_prints_the_overrides_and_a_composed_recipe_is_refused(tmp_path, capsys):
    main(["qwen3-math", str(tmp_path), "--steps", "3"])
    overrides = json.loads(capsys.readouterr().out)
    assert "loop.total_steps=3" in overrides and "lm.model.model=tiny" in overrides
    other = tmp_path / "other.yaml"
    other.write_text("name: other\nfamily: video\n")
    with pytest.raises(ConfigError, match=r"family='video'.*'diffusion' or 'lm'"):
        rehearsal_overrides(str(other), str(tmp_path))
