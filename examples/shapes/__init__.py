"""The shapes world: a synthetic world of coloured shapes, its captions, a rule-based compositional reward and the
project's own text-to-image model of it (``shapes-sd3``, shipped weights). See README.md.

Registers (when imported; the recipe loader imports it for its recipes, the registries on a name they miss):
- prompt source ``shapes`` (``data.source: shapes``, settings ``data.shapes``) and SFT record source ``shapes``;
- scorers ``shapes_compositional``, ``shapes_object``, ``shapes_count``, ``shapes_color``, ``shapes_position``;
- diffusion presets ``shapes-sd3-init`` (random init), ``shapes-sd3`` and ``shapes-sd3-long`` (shipped weights) and
  the tokenizer preset ``shapes-words``.
"""

from examples.shapes import data, model
from examples.shapes.sft import ShapesSourceConfig
from unirl_core.data import register_prompt_source
from unirl_core.models.presets import register_diffusion_preset, register_tokenizer_preset
from unirl_core.reward.scorers import register_scorer
from unirl_core.sft.sources import register_record_source

register_prompt_source("shapes", section="shapes", config=data.ShapesPromptsConfig, build=data.shapes_prompts)
register_record_source("shapes", section="shapes", config=ShapesSourceConfig,
                       build="examples.shapes.sft:shapes_records", families=("diffusion",))
for _name, _cls in (("shapes_compositional", "ShapesCompositional"), ("shapes_object", "ShapesObjectScore"),
                    ("shapes_count", "ShapesCountScore"), ("shapes_color", "ShapesColorScore"),
                    ("shapes_position", "ShapesPositionScore")):
    register_scorer(_name, f"examples.shapes.reward:{_cls}")


def _shipped(name: str):
    return lambda _config: model.shipped_shapes_pipeline(name)


register_diffusion_preset("shapes-sd3-init", family="sd3",
                          build=lambda config: model.shapes_sd3_pipeline(seed=config.seed))
for _name in model.SHIPPED:
    register_diffusion_preset(_name, family="sd3", build=_shipped(_name))
register_tokenizer_preset("shapes-words", build=lambda: model.word_tokenizer(512))
