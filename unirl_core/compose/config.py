"""ComposeRunConfig: a prompt-enhancement run - an AR enhancer stack chained into a diffusion image stack.

Each stack is an ordinary single-family ``RunConfig`` underneath (``stack_configs``): the enhancer a ``family: lm``
run, the image stack a ``family: diffusion`` run, each with its own train config (optimizer, micro-batches),
checkpoint store (``<checkpoint.root>/<name>/enhancer``, ``.../image``) and publication. Deriving them runs every
check of the single-family loop (geometry vs micro-batches, exactness of ``old_logp_source``, algorithm knobs),
with errors re-labelled under the stack's section (``enhancer.train.micro_batch_size=...``).
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from unirl_core.advantage.config import AdvantageConfig
from unirl_core.checkpoint.ref import step_dirname
from unirl_core.compose.eval_config import ComposeEvalConfig
from unirl_core.config.loader import from_dict, refuse
from unirl_core.compose.warm_pairs import warm_pairs_entry
from unirl_core.config.recipes import load_recipe_dict, recipe_names
from unirl_core.config.run import CheckpointConfig, DataConfig, DiffusionSection, LMSection, LoopConfig, ReportConfig, RunConfig
from unirl_core.errors import ConfigError, check_ints, field_error
from unirl_core.config.pool import PoolConfig
from unirl_core.reward.config import RewardConfig
from unirl_core.train.config import TrainConfig

ImageGroups = Literal["enhancement", "prompt"]
ImageNoise = Literal["independent", "paired"]
STACKS: tuple[str, ...] = ("enhancer", "image")
ENHANCER_REFERENCE = "enhancer-reference"
"""Run (store) name, under the compose run's root, of the warm-started enhancer's weights: the KL reference."""
COMPOSE_RECIPE_DIR = Path(__file__).resolve().parent / "recipes"


@dataclass(frozen=True, kw_only=True)
class GroupingConfig:
    """How one prompt fans out: ``enhancements_per_prompt`` enhanced prompts, each rendered
    ``images_per_enhancement`` times (sample ids ``<prompt id>/<i>/<j>``: enhancement i, image j)."""

    enhancements_per_prompt: int = 4
    """G_e: enhanced prompts sampled per prompt. The enhancer's GRPO group is the G_e enhancements of one prompt
    (each carries the mean reward of its images)."""
    images_per_enhancement: int = 2
    """G_i: images sampled per enhanced prompt (1: one image each)."""
    image_groups: ImageGroups = "enhancement"
    """Where image advantages normalise: ``enhancement`` (the G_i images of one enhanced prompt: the image stack
    learns to render the text it got; needs G_i >= 2) or ``prompt`` (all G_e x G_i images of a prompt)."""

    image_noise: ImageNoise = "independent"
    """``independent``: every image of a prompt draws its own noise (x_T and SDE stream). ``paired``: image j of
    every enhancement of a prompt renders from the same noise (common random numbers), so the enhancer's group
    compares its rewrites on identical noise and the noise's share of the reward cancels out of its advantages."""

    def __post_init__(self) -> None:
        if self.image_noise not in ("independent", "paired"):
            raise field_error(ConfigError, "grouping.image_noise", self.image_noise, "'independent' or 'paired'",
                              "pick how the images of a prompt's enhancements draw their noise")
        check_ints("grouping", self, ("enhancements_per_prompt", "images_per_enhancement"), "use e.g. 4")
        if self.image_groups not in ("enhancement", "prompt"):
            raise field_error(ConfigError, "grouping.image_groups", self.image_groups, "'enhancement' or 'prompt'",
                              "pick the level image advantages normalise at")
        if self.image_groups == "enhancement" and self.images_per_enhancement < 2:
            raise field_error(ConfigError, "grouping.images_per_enhancement", self.images_per_enhancement,
                              ">= 2 with image_groups='enhancement'",
                              "a group of one image has no advantage; raise it or set image_groups='prompt'")

    @property
    def images_per_prompt(self) -> int:
        return self.enhancements_per_prompt * self.images_per_enhancement


@dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """A supervised warm start of the enhancer before its step-0 version: completion cross-entropy on pairs built
    from the run's own prompt set (``pairs``), so a random-init LM emits well-formed prompts."""

    steps: int = 0
    """Optimizer steps (0: none, the step-0 version is the model as built)."""
    batch_size: int = 32
    """Prompts per step (drawn from the data set by a seeded permutation)."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start (its own optimizer; the RL optimizer starts fresh)."""
    seed: int = 0
    """Seed of the prompt order."""
    pairs: str = "copy"
    """What the warm start writes for a prompt, a registered maker (``unirl_core.compose.warm_pairs``): ``copy`` the
    prompt itself, or a plugin's (``add_colour`` of ``examples/compose_enhance``: the prompt with one of
    ``colours`` added, "two circles" -> "two red circles": an enhancer that already adds a colour, without knowing
    which one the reward wants, the stand-in for a pretrained enhancer's habit of adding detail)."""
    colours: tuple[str, ...] = ()
    """The words a maker that adds one draws from (``add_colour``: colour names of the shapes palette)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "colours", tuple(self.colours))
        entry = warm_pairs_entry(self.pairs)
        if entry.check is not None:
            entry.check(self)
        for name in ("steps", "batch_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= (0 if name == "steps" else 1)):
                raise field_error(ConfigError, f"enhancer.warm_start.{name}", v, "a non-negative integer "
                                  "(batch_size >= 1)", "use e.g. steps: 60, batch_size: 32")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise field_error(ConfigError, "enhancer.warm_start.lr", self.lr, "a number > 0", "use e.g. 3e-3")


@dataclass(frozen=True, kw_only=True)
class EnhancerStack:
    """The AR stack that rewrites each prompt (Part 0 of every Sample), trained with an LM algorithm."""

    lm: LMSection = field(default_factory=LMSection)
    """Model, sampling, trainside engine and loss (``lm.algorithm``: grpo, cispo, ...). Only the trainside engine."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The enhancer's own optimizer and micro-batches (over the P x G_e enhancements of a step)."""
    frozen: bool = False
    """Sample with the step-0 weights and never train (its version stays 0)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start (copy the prompt, or add a colour to it) before the step-0 version."""


@dataclass(frozen=True, kw_only=True)
class ImageStack:
    """The diffusion stack that renders each enhanced prompt (Part 1, ``parent=0``), trained with a diffusion
    algorithm (Flow-GRPO, NFT, ...)."""

    diffusion: DiffusionSection = field(default_factory=DiffusionSection)
    """Model, sampling, engine and loss of the image model."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The image stack's own optimizer and micro-batches (over the P x G_e x G_i images of a step)."""
    frozen: bool = False
    """Sample with the step-0 weights and never train (its version stays 0)."""


@dataclass(frozen=True, kw_only=True)
class ComposeRunConfig:
    """One prompt-enhancement run: prompts -> enhancer (AR Part) -> image model (diffusion Part) -> reward of the
    image against the ORIGINAL prompt -> both Parts trained in sibling stacks."""

    name: str
    """Run name: the folder under ``checkpoint.root`` holding both stacks' stores and the report."""
    enhancer: EnhancerStack = field(default_factory=EnhancerStack)
    image: ImageStack = field(default_factory=ImageStack)
    grouping: GroupingConfig = field(default_factory=GroupingConfig)
    data: DataConfig
    """Prompt source and ``prompts_per_step``; leave ``samples_per_prompt`` unset (``grouping`` sets the group sizes)."""
    reward: RewardConfig
    """Scorers of the image (they read the diffusion Part: the original prompt, the image)."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Group normalisation, applied to each stack within its own groups (``drop_zero_std_groups`` unsupported)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    pool: PoolConfig = field(default_factory=lambda: PoolConfig(publish="object_store"))
    """``execution: pool``: the composed rollout on one engine actor holding both rollout bundles, the image's
    reward on the reward actor, each trained stack on a trainer actor of its own (``compose/pool.py``). Built:
    placement ``colocate`` / ``separate``, one engine, one rank per stack, ``publish: object_store`` (the default
    here), a local head or the Ray this process is connected to; the rest is refused naming its field."""
    eval: ComposeEvalConfig | None = None
    """Greedy enhancement vs the prompt itself, fixed-noise images of every prompt (``compose/evaluate.py``) at step 0,
    every ``eval.every_n_steps`` and the last step (``run_compose_local``); None: none."""
    plugins: tuple[str, ...] = ()
    """Modules imported before this config is checked, registering what the recipe names (prompt sources,
    environments, scorers, presets): e.g. ``[examples.shapes]`` (``unirl_core/plugins.py``)."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise field_error(ConfigError, "name", self.name, "a non-empty run name without '/'", "e.g. shapes-enhance")
        refused = [  # (field, value, refused, expected, fix)
            ("data.samples_per_prompt", self.data.samples_per_prompt,
             self.data.samples_per_prompt != DataConfig.__dataclass_fields__["samples_per_prompt"].default,
             "unset in a compose run", "set grouping.enhancements_per_prompt / images_per_enhancement"),
            ("enhancer.frozen", True, self.enhancer.frozen and self.image.frozen, "at most one frozen stack",
             "nothing would train; unfreeze enhancer or image"),
            ("advantage.drop_zero_std_groups", True, self.advantage.drop_zero_std_groups, "False in a compose run",
             "dropping groups of one stack would orphan Parts of the other; leave it False"),
            ("loop.rollout_shards", self.loop.rollout_shards, self.loop.rollout_shards != 1, "1 in a compose run",
             "the composed rollout runs as one shard"),
            ("checkpoint.every_n_steps", self.checkpoint.every_n_steps, self.checkpoint.every_n_steps != 1,
             "1 in a compose run", "each stack's version holds its full state every step here; leave it at 1"),
            ("loop.rollout_with_trainer", True, self.loop.rollout_with_trainer is True, "unset or false in a compose run",
             "the composed engine samples with rollout bundles of its own; remove the setting"),
            ("checkpoint.fork_from", self.checkpoint.fork_from, self.checkpoint.fork_from is not None,
             "unset in a compose run", "forks start RL runs (run_local, workflows/grpo.py); remove the setting"),
            ("report.wandb", "set", self.report.wandb is not None, "unset in a compose run",
             "W&B is not wired for compose runs yet; TensorBoard scalars are written"),
            ("report.mlflow", "set", self.report.mlflow is not None, "unset in a compose run",
             "MLflow is not wired for compose runs yet; TensorBoard scalars are written")]
        refuse(refused)
        if _warm_reference(self) and (self.enhancer.lm.model.finetune != "full"
                                      or not self.enhancer.lm.model.keep_reference):
            raise field_error(ConfigError, "enhancer.lm.algorithm.beta", self.enhancer.lm.algorithm.beta,
                              "0 unless enhancer.lm.model has finetune: full and keep_reference: true",
                              "the KL reference is the warm-started enhancer, a frozen copy only a full fine-tune "
                              "keeps (a LoRA reference is the base model before the warm start); set beta: 0 or "
                              "train the enhancer full with keep_reference: true")
        ws = self.enhancer.warm_start
        check_run = warm_pairs_entry(ws.pairs).check_run
        if ws.steps and check_run is not None:
            check_run(self)
        check_compose_pool(self)
        stack_configs(self)  # every single-family check, per stack

    @property
    def trained(self) -> tuple[str, ...]:
        """Names of the stacks that train (``enhancer``, ``image``)."""
        return tuple(s for s in STACKS if not getattr(self, s).frozen)

    @property
    def run_root(self) -> str:
        """``<checkpoint.root>/<name>``: the stores of both stacks and the report live under it."""
        return f"{self.checkpoint.root.rstrip('/')}/{self.name}"


def check_compose_pool(cfg: ComposeRunConfig) -> None:
    """Refuse, naming the field, the pool settings compose runs do not have (yet)."""
    p = cfg.pool
    if p.execution != "pool":
        return
    unbuilt = (("pool.placement", p.placement, p.placement != "shared", "'colocate' or 'separate'",
                "a shared trainer+engine process holds one stack; compose has two"),
               ("pool.num_engines", p.num_engines, p.num_engines == 1, "1", "one engine actor samples both Parts"),
               ("pool.trainer_ranks", p.trainer_ranks, p.trainer_ranks == 1, "1",
                "a sharded trainer group per stack is not built"),
               ("pool.publish", p.publish, p.publish == "object_store", "'object_store'",
                "the collective publish group holds one trainer; compose sends each stack through the object store"),
               ("pool.address", p.address, p.address is None, "unset",
                "attaching to a cluster (detached actors across task pods) is not built for compose runs"),
               ("pool.kuberay", "set" if p.kuberay else None, p.kuberay is None, "unset",
                "the KubeRay setup task is not wired for compose runs"),
               ("image.diffusion.algorithm.rollout_weights", "ema",
                getattr(cfg.image.diffusion.algorithm, "rollout_weights", "policy") == "policy", "'policy'",
                "EMA rollouts are not built in the pool"))
    refuse([(name, value, not ok, f"{expected} with pool.execution='pool' in a compose run",
             f"{why}; or run it with pool.execution='pods'") for name, value, ok, expected, why in unbuilt])


def _warm_reference(cfg: ComposeRunConfig) -> bool:
    """True when the enhancer has a KL term to its warm-started self (warm start and beta > 0)."""
    return bool(cfg.enhancer.warm_start.steps) and (getattr(cfg.enhancer.lm.algorithm, "beta", 0.0) or 0.0) > 0


def enhancer_reference_uri(cfg: ComposeRunConfig) -> str:
    """The version holding the warm-started enhancer's weights (written with its step-0 version)."""
    return posixpath.join(cfg.run_root, ENHANCER_REFERENCE, step_dirname(0))


def _stack(cfg: ComposeRunConfig, stack: str, **section) -> RunConfig:
    if stack == "enhancer" and _warm_reference(cfg):  # KL to the warm-started enhancer, not the random init
        lm = section["lm"]
        section["lm"] = dataclasses.replace(lm, model=dataclasses.replace(lm.model,
                                                                          reference=enhancer_reference_uri(cfg)))
    group = (cfg.grouping.enhancements_per_prompt if stack == "enhancer" else cfg.grouping.images_per_prompt)
    try:
        return RunConfig(name=stack, data=dataclasses.replace(cfg.data, samples_per_prompt=group),
                         reward=cfg.reward, advantage=cfg.advantage, train=getattr(cfg, stack).train,
                         checkpoint=dataclasses.replace(cfg.checkpoint, root=cfg.run_root), loop=cfg.loop,
                         report=dataclasses.replace(cfg.report, tensorboard=False, wandb=None, mlflow=None), **section)
    except ConfigError as e:
        # The stack's RunConfig names `train.x` / `lm.x`; in a compose recipe those live under the stack.
        raise ConfigError(f"{stack}.{e} (in the {stack} stack: {group} samples per prompt per step)") from e


def stack_configs(cfg: ComposeRunConfig) -> dict[str, RunConfig]:
    """The single-family run config of each stack: ``{"enhancer": family lm, "image": family diffusion}``."""
    if cfg.enhancer.lm.deployment.engine != "trainside":
        raise field_error(ConfigError, "enhancer.lm.deployment.engine", cfg.enhancer.lm.deployment.engine,
                          "'trainside' in a compose run", "a dedicated enhancer engine is not wired yet")
    lm = _stack(cfg, "enhancer", family="lm", lm=cfg.enhancer.lm)
    image = _stack(cfg, "image", family="diffusion", diffusion=cfg.image.diffusion)
    return {"enhancer": lm, "image": image}


def compose_recipe_names() -> list[str]:
    return recipe_names(COMPOSE_RECIPE_DIR, "compose")


def load_compose_recipe(name_or_path: str, overrides: Sequence[str] = ()) -> ComposeRunConfig:
    """A shipped compose recipe (``unirl_core/compose/recipes``, a plugin's ``recipes/compose``) or a YAML path,
    ``a.b=value`` overrides applied."""
    data = load_recipe_dict(name_or_path, overrides, COMPOSE_RECIPE_DIR, "compose recipe", "compose")
    return from_dict(ComposeRunConfig, data, "recipe")
