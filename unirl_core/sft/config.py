"""SFTConfig: one typed tree for a supervised fine-tuning run (records -> supervised Parts -> train).

It reuses the sections of the RL run where they mean the same thing (``DiffusionModelConfig``, ``LMConfig``,
``TrainConfig``, ``CheckpointConfig``) and adds what only SFT has: the record source, the loss knobs and the
length of the run. Recipes are YAML files in ``unirl_core/sft/recipes`` (``sft-*.yaml``), a plugin's ``recipes/sft`` or any path; they are
parsed by the same strict loader as the RL recipes (unknown keys and wrong types name the dotted path).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from unirl_core.config.loader import Sectioned, from_dict, refuse
from unirl_core.config.recipes import load_recipe_dict, recipe_names
from unirl_core.config.run import CheckpointConfig, check_name_and_family
from unirl_core.errors import ConfigError, check_ints, field_error
from unirl_core.models.diffusion import DiffusionModelConfig
from unirl_core.models.lm import LMConfig
from unirl_core.rollout.agentic import CHATML_OBSERVATION
from unirl_core.sft import sources as record_sources
from unirl_core.train.config import TrainConfig

SFTFamily = Literal["diffusion", "lm"]
SigmaSampling = Literal["logit_normal", "uniform"]

RECIPE_DIR = Path(__file__).resolve().parent / "recipes"


@dataclass(frozen=True, kw_only=True)
class FlowMatchingConfig:
    """Rectified-flow loss: x_sigma = (1 - sigma) x0 + sigma eps, the transformer predicts eps - x0."""

    sigma_sampling: SigmaSampling = "logit_normal"
    """How the per-sample sigma is drawn: ``logit_normal`` (sigmoid of N(logit_mean, logit_std), the SD3
    paper's choice: most weight on mid-range noise) or ``uniform`` on (0, 1)."""
    logit_mean: float = 0.0
    """Mean of the normal under the sigmoid (``logit_normal`` only)."""
    logit_std: float = 1.0
    """Std of the normal under the sigmoid (``logit_normal`` only)."""
    caption_dropout: float = 0.0
    """Probability of training a sample on the empty caption (what CFG's unconditional branch sees);
    0 disables it. Use e.g. 0.1 for a model that will sample with ``guidance_scale > 1``."""

    def __post_init__(self) -> None:
        if self.sigma_sampling not in ("logit_normal", "uniform"):
            raise field_error(ConfigError, "diffusion.loss.sigma_sampling", self.sigma_sampling,
                              "'logit_normal' or 'uniform'", "use 'logit_normal'")
        if not (math.isfinite(self.logit_std) and self.logit_std > 0):
            raise field_error(ConfigError, "diffusion.loss.logit_std", self.logit_std, "a finite number > 0",
                              "use 1.0")
        if not math.isfinite(self.logit_mean):
            raise field_error(ConfigError, "diffusion.loss.logit_mean", self.logit_mean, "a finite number", "use 0.0")
        if not (0.0 <= self.caption_dropout < 1.0):
            raise field_error(ConfigError, "diffusion.loss.caption_dropout", self.caption_dropout,
                              "a probability in [0, 1)", "use 0.0 (off) or e.g. 0.1")


@dataclass(frozen=True, kw_only=True)
class SFTDiffusionSection:
    """Model and loss of a diffusion SFT run."""

    model: DiffusionModelConfig = field(default_factory=DiffusionModelConfig)
    loss: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)
    height: int = 64
    """Image height every record must have (pixels; a multiple of the VAE factor x 2)."""
    width: int = 64
    """Image width every record must have."""


@dataclass(frozen=True, kw_only=True)
class SFTPromptConfig:
    """How prompts become token ids; keep it equal to the RL run's ``lm.engine`` so both see one format."""

    apply_chat_template: bool | None = None
    """Wrap the prompt as one user message of the tokenizer's chat template; None = when it has one."""
    system_prompt: str | None = None
    """Optional system message (chat template only)."""
    observation_template: str = CHATML_OBSERVATION
    """Multi-turn records (``turns``): how an ``env`` turn becomes tokens; keep it equal to the RL run's
    ``lm.agent.observation_template`` (``unirl_core/rollout/agentic.py``)."""


@dataclass(frozen=True, kw_only=True)
class SFTLMSection:
    """Model and prompt format of an LM SFT run (loss: cross-entropy over the completion tokens)."""

    model: LMConfig = field(default_factory=LMConfig)
    prompt: SFTPromptConfig = field(default_factory=SFTPromptConfig)
    max_completion_tokens: int = 256
    """Completions are cut to this many tokens (EOS included); longer ones are truncated, not dropped."""

    def __post_init__(self) -> None:
        check_ints("lm", self, ("max_completion_tokens",), "use e.g. 256")


@dataclass(frozen=True, kw_only=True)
class SFTDataConfig(Sectioned):
    """Where records come from and how many go into one step."""

    source: Annotated[str, record_sources.RECORD_SOURCE] = "jsonl"
    """``jsonl`` (``path``: one JSON object per line) or a registered record source (``unirl_core.sft.sources``):
    ``toy_arithmetic`` (prompts and answers of the toy task, settings ``data.toy``: the warm start that teaches an
    LM the answer format before GRPO on correctness) or a plugin's (e.g. ``shapes`` of ``examples/shapes``:
    generated captioned images, settings ``data.shapes``)."""
    path: str | None = None
    """JSONL file. Diffusion rows: ``{"caption": ..., "image": <png path, relative to the file>}``;
    LM rows: ``{"prompt": ..., "completion": ...}``."""
    batch_size: int = 16
    """Records per step (one optimizer update per step; split into ``train.micro_batch_size`` pieces)."""
    seed: int = 0
    """Seed of the per-epoch shuffle of the records."""
    sections: dict[str, Any] = field(default_factory=dict)
    """The settings of registered record sources by section (``data.toy: {...}``: in a recipe they are keys of
    ``data`` themselves, see ``unirl_core.config.loader``); a source without its section uses its defaults."""

    SECTIONS_FIELD: ClassVar[str] = "sections"
    SECTIONS_KIND: ClassVar[str] = "record source (unirl_core.sft.sources)"
    section_config = staticmethod(record_sources.section_config)
    section_names = staticmethod(record_sources.section_names)

    def __post_init__(self) -> None:
        self.check_sections()
        if self.source != "jsonl":
            record_sources.record_source(self.source)  # refuses a name nobody registered
        if self.source == "jsonl" and not self.path:
            raise field_error(ConfigError, "data.path", self.path, "a .jsonl file for source='jsonl'",
                              "set data.path, or use a generated record source")
        check_ints("data", self, ("batch_size",), "use e.g. 16")


@dataclass(frozen=True, kw_only=True)
class SFTLoopConfig:
    """Length of the run and how often a version is written."""

    total_steps: int = 100
    """Optimizer steps of the whole run."""
    steps_per_chunk: int = 50
    """Steps one train task runs; each chunk ends with a version (published). Bounds the work a crash loses."""
    seed: int = 0
    """Base seed of the noise / sigma / caption-dropout draws (per step: ``stable_seed(seed, 'sft', step)``)."""
    log_every: int = 10
    """Steps between progress lines."""
    export_ema: bool = False
    """Export (``export_model``) the EMA weights instead of the trained ones; needs ``train.ema_decay``."""

    def __post_init__(self) -> None:
        check_ints("loop", self, ("total_steps", "steps_per_chunk", "log_every"), "use e.g. 50")


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """One SFT run: family, its model section, records, optimizer, checkpoints and length."""

    name: str
    """Run name: the checkpoint folder under ``checkpoint.root``."""
    family: SFTFamily
    """``diffusion`` (flow-matching loss) or ``lm`` (completion cross-entropy)."""
    diffusion: SFTDiffusionSection | None = None
    """Required for ``family='diffusion'``."""
    lm: SFTLMSection | None = None
    """Required for ``family='lm'``."""
    data: SFTDataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer and micro-batching. ``micro_batch_size`` must divide ``data.batch_size``;
    ``num_updates_per_batch`` must stay 1 and ``old_logp_source`` 'rollout' (no log-probs in SFT)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    loop: SFTLoopConfig = field(default_factory=SFTLoopConfig)
    plugins: tuple[str, ...] = ()
    """Modules imported before this config is checked, registering what the recipe names (prompt sources,
    environments, scorers, presets): e.g. ``[examples.shapes]`` (``unirl_core/plugins.py``)."""

    def __post_init__(self) -> None:
        check_name_and_family(self, "sft-shapes")
        ck, t = self.checkpoint, self.train
        full_state = "an SFT version holds its full state every step; remove the setting"
        refuse([  # (field, value, refused, expected, fix)
            ("checkpoint.every_n_steps", ck.every_n_steps, ck.every_n_steps != 1, "the default in an SFT run",
             full_state),
            ("checkpoint.full_state", ck.full_state, ck.full_state != "file", "the default in an SFT run", full_state),
            ("checkpoint.fork_from", ck.fork_from, ck.fork_from is not None, "unset in an SFT run",
             "forks start RL runs (run_local, workflows/grpo.py); remove the setting"),
            ("train.micro_batch_size", t.micro_batch_size, self.data.batch_size % t.micro_batch_size,
             f"a divisor of data.batch_size ({self.data.batch_size})",
             "pick micro-batches that split a step's records evenly"),
            ("train.num_updates_per_batch", t.num_updates_per_batch, t.num_updates_per_batch != 1,
             "1 for SFT (every step draws fresh records)", "raise data.batch_size instead"),
            ("train.old_logp_source", t.old_logp_source, t.old_logp_source != "rollout",
             "'rollout' for SFT (there is no pi_old to replay)", "remove the field"),
            ("loop.export_ema", True, self.loop.export_ema and t.ema_decay is None,
             "False unless train.ema_decay is set", "set train.ema_decay (e.g. 0.99) or export the trained weights")])
        if self.data.source != "jsonl":
            entry = record_sources.record_source(self.data.source)
            if self.family not in entry.families:
                ok = ["jsonl", *(n for n in record_sources.RECORD_SOURCES.names()[1:]
                                 if self.family in record_sources.record_source(n).families)]
                raise field_error(ConfigError, "data.source", self.data.source,
                                  f"{' or '.join(repr(n) for n in ok)} for family={self.family!r}",
                                  f"{self.data.source!r} feeds {' / '.join(entry.families)} runs; give records in a "
                                  ".jsonl file")

    @property
    def section(self) -> SFTDiffusionSection | SFTLMSection:
        return self.diffusion if self.family == "diffusion" else self.lm


def sft_recipe_names() -> list[str]:
    """Names of the SFT recipes shipped with the package."""
    return recipe_names(RECIPE_DIR, "sft")


def load_sft_recipe_dict(name_or_path: str, overrides: Sequence[str] = ()) -> dict:
    """The recipe's YAML mapping with ``a.b=value`` overrides applied (not validated yet)."""
    return load_recipe_dict(name_or_path, overrides, RECIPE_DIR, "SFT recipe", "sft")


def load_sft_recipe(name_or_path: str, overrides: Sequence[str] = ()) -> SFTConfig:
    """Parse an SFT recipe (shipped name or YAML path), apply overrides, validate every field."""
    return from_dict(SFTConfig, load_sft_recipe_dict(name_or_path, overrides), "recipe")
