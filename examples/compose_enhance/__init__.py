"""The composed enhancement world: a prompt-enhancer LM in front of the shapes-world image model, trained on how
well the image satisfies the ORIGINAL prompt (``unirl_core.compose``). See README.md.

Registers the warm-start pairs ``add_colour`` (``enhancer.warm_start.pairs``: each prompt once with each of
``enhancer.warm_start.colours`` added before its shape words); the shapes world (``examples.shapes``: prompts,
rewards, ``shapes-sd3-long``, the ``shapes-words`` tokenizer) is imported with it. Recipes (compose):
``shapes-enhance``, ``shapes-enhance-joint``, ``shapes-enhance-colour``. Also the scorer ``caption_recall``
(``faithfulness.py``): how much of the caption a rewrite keeps, for re-scoring a run's enhancer Parts.
"""

from examples.shapes.data import check_colours, with_colour
from unirl_core.compose.warm_pairs import register_warm_pairs
from unirl_core.errors import ConfigError, field_error
from unirl_core.reward.scorers import register_scorer

register_scorer("caption_recall", "examples.compose_enhance.faithfulness:CaptionRecall")


def _add_colour(records, cfg) -> list[tuple[str, str]]:
    return [(r.prompt, with_colour(r.prompt, c)) for r in records for c in cfg.colours]


def _check(cfg) -> None:
    check_colours("enhancer.warm_start.colours", cfg.colours)


def _check_run(run) -> None:
    """The prompts must be shapes prompts with their colour left out, so there is a colour to add."""
    if run.data.source != "shapes" or "colour" not in run.data.section("shapes").omit:
        raise field_error(ConfigError, "enhancer.warm_start.pairs", run.enhancer.warm_start.pairs,
                          "shapes prompts with their colour left out (data.source: shapes, "
                          "data.shapes.omit: [colour])", "set data.shapes.omit: [colour] or pairs: copy")


register_warm_pairs("add_colour", make=_add_colour, check=_check, check_run=_check_run)
