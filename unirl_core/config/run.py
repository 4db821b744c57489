"""RunConfig: the whole run, one typed tree, saved with every checkpoint and shown in the run report."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from unirl_core.advantage.config import AdvantageConfig, StatTrackerConfig
from unirl_core.algorithms.flow_grpo import FlowGRPOConfig
from unirl_core.algorithms.grpo import GRPOConfig
from unirl_core.algorithms.registry import AlgorithmChoice
from unirl_core.checkpoint.lease import LeaseConfig
from unirl_core.config.deployment_checks import check_lm_deployment
from unirl_core.config.loader import Sectioned, from_dict, refuse
from unirl_core.sde.sampling_config import DiffusionSamplingConfig
from unirl_core.data.prompts import PromptDataConfig, check_prompts_per_step
from unirl_core.data import sources as prompt_sources
from unirl_core.errors import ConfigError, check_ints, field_error
from unirl_core.advantage.dynamic_sampling import FilterGroupsConfig
from unirl_core.config.eval import EvalConfig, check_eval_config
from unirl_core.models.diffusion import DiffusionModelConfig
from unirl_core.models.lm import LMConfig
from unirl_core.config.pool import PoolConfig, check_dedicated, check_named, check_pool_features, check_shared
from unirl_core.report.mlflow_log import MlflowConfig
from unirl_core.report.wandb_log import WandbConfig
from unirl_core.reward.config import RewardConfig
from unirl_core.rollout.agentic import AgentConfig, check_agent_config
from unirl_core.rollout.ar import AREngineConfig
from unirl_core.rollout.diffusion import DiffusionEngineConfig
from unirl_core.rollout.logp_check import LogpCheckConfig
from unirl_core.rollout.modes import DeploymentConfig
from unirl_core.rollout.registry import BUILT_IN_SECTIONS, engine_entry
from unirl_core.rollout.sglang.config import SGLangEngineConfig
from unirl_core.rollout.vllm.config import VLLMEngineConfig
from unirl_core.train.config import TrainConfig
from unirl_core.types import ARSamplingParams

Family = Literal["diffusion", "lm"]


@dataclass(frozen=True, kw_only=True)
class DiffusionSection:
    """Model, sampling, engine and loss of a Flow-GRPO run."""

    model: DiffusionModelConfig = field(default_factory=DiffusionModelConfig)
    sampling: DiffusionSamplingConfig = field(default_factory=DiffusionSamplingConfig)
    engine: DiffusionEngineConfig = field(default_factory=DiffusionEngineConfig)
    algorithm: Annotated[Any, AlgorithmChoice("diffusion")] = field(default_factory=FlowGRPOConfig)
    """The loss, picked by ``name`` from the registry (``unirl_core/algorithms/registry.py``); no name:
    ``flow_grpo``. The other keys are that algorithm's config fields."""


@dataclass(frozen=True, kw_only=True)
class LMSection:
    """Model, sampling, engine, deployment and loss of a GRPO run."""

    model: LMConfig = field(default_factory=LMConfig)
    sampling: ARSamplingParams = field(default_factory=ARSamplingParams)
    engine: AREngineConfig = field(default_factory=AREngineConfig)
    """The trainside engine (``deployment.engine='trainside'``); must stay default with a dedicated engine (its
    prompt format is ``vllm.prompt`` / ``sglang.prompt``). ``seed`` must stay default: the loop seeds rollouts."""
    algorithm: Annotated[Any, AlgorithmChoice("lm")] = field(default_factory=GRPOConfig)
    """The loss, picked by ``name`` from the registry (``grpo``, ``cispo``, ...); no name: ``grpo``. The
    other keys are that algorithm's config fields."""
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    """Which engine samples and where: trainside (direct) or a dedicated vLLM/SGLang server (separate,
    colocate) that receives every published version."""
    vllm: VLLMEngineConfig | None = None
    """The vLLM server (``deployment.engine='vllm'``). Leave ``vllm.model`` unset to start it from the run's
    step-0 policy, which ``init_run`` exports as a HF folder to ``<checkpoint.root>/<name>/hf-init``."""
    sglang: SGLangEngineConfig | None = None
    """The SGLang server to attach to (``deployment.engine='sglang'``, ``sglang.base_url`` required)."""
    logp_check: LogpCheckConfig = field(default_factory=LogpCheckConfig)
    """Fail-closed bounds on |engine log-prob - trainer replay| of every dedicated-engine rollout."""
    agent: AgentConfig | None = None
    """Multi-turn rollouts with an environment (``unirl_core/rollout/agentic.py``; ``sampling.max_new_tokens``
    caps each model turn); None: single-turn completions."""

    dedicated_engine: dict[str, Any] | None = None
    """The settings of a registered dedicated engine other than vLLM and SGLang (``lm.deployment.engine`` names
    it; ``unirl_core.rollout.registry``): a mapping of that engine's config fields."""

    def __post_init__(self) -> None:
        entry = engine_entry(self.deployment.engine, "lm.deployment.engine")
        parsed = None
        if self.dedicated_engine is not None:
            if not entry.dedicated or entry.section != "lm.dedicated_engine":
                raise field_error(ConfigError, "lm.dedicated_engine", "set",
                                  f"unset with lm.deployment.engine={self.deployment.engine!r}",
                                  f"remove it (the {entry.name} engine's settings are {entry.section})"
                                  if entry.dedicated else "remove it, or name its engine in lm.deployment.engine")
            parsed = from_dict(entry.config, self.dedicated_engine, "lm.dedicated_engine")
        object.__setattr__(self, "_dedicated_engine", parsed)

    @property
    def dedicated(self) -> Any:
        """The dedicated engine's config (``lm.vllm``, ``lm.sglang`` or the parsed ``lm.dedicated_engine``), None
        for trainside sampling."""
        kind = self.deployment.engine
        if kind in BUILT_IN_SECTIONS:
            return getattr(self, kind)
        return self._dedicated_engine


@dataclass(frozen=True, kw_only=True)
class DataConfig(Sectioned):
    """Where prompts come from and how many go into one step."""

    source: Annotated[str, prompt_sources.PROMPT_SOURCE] = "inline"
    """``inline`` (``prompts`` below), ``file`` (jsonl/parquet/HF) or a registered generated prompt set
    (``unirl_core.data.sources``): ``toy_arithmetic`` (built-in verifiable task, settings ``data.toy``) or a
    plugin's (e.g. ``shapes`` of ``examples/shapes``, settings ``data.shapes``)."""
    prompts: tuple[str, ...] = ()
    """Inline prompt texts (``source='inline'``)."""
    file: PromptDataConfig | None = None
    """Prompt file (``source='file'``)."""
    prompts_per_step: int = 4
    """Distinct prompts (groups) per step; at most the number of prompts of the source. Each step takes the next
    ``prompts_per_step`` of a stream of per-epoch shuffles; a step spanning two epochs still draws no prompt
    twice (``PromptDataset.epoch_order``)."""
    samples_per_prompt: int = 4
    """Siblings per prompt (the GRPO group size)."""
    seed: int = 0
    """Seed of the per-epoch prompt shuffle."""
    sections: dict[str, Any] = field(default_factory=dict)
    """The settings of generated prompt sets by section (``data.toy: {...}``, ``data.shapes: {...}``: in a recipe
    they are keys of ``data`` themselves, see ``unirl_core.config.loader``); a source without its section uses its
    defaults."""

    SECTIONS_FIELD: ClassVar[str] = "sections"
    SECTIONS_KIND: ClassVar[str] = "prompt source (unirl_core.data.sources)"
    section_config = staticmethod(prompt_sources.section_config)
    section_names = staticmethod(prompt_sources.section_names)

    def __post_init__(self) -> None:
        self.check_sections()
        if self.source not in prompt_sources.OWN_SOURCES:
            prompt_sources.prompt_source(self.source)  # refuses a name nobody registered
        if self.source == "inline" and not self.prompts:
            raise field_error(ConfigError, "data.prompts", self.prompts, "at least one prompt for source='inline'",
                              "list prompts or pick source='toy_arithmetic' / 'file'")
        if self.source == "file" and self.file is None:
            raise field_error(ConfigError, "data.file", None, "a PromptDataConfig for source='file'",
                              "add data.file.path")
        check_ints("data", self, ("prompts_per_step", "samples_per_prompt"), "use e.g. 4")
        # The prompt count of these sources is known here; a file's is checked where it is read
        # (``unirl_core.runtime.build``).
        if self.source == "inline":
            check_prompts_per_step(self.prompts_per_step, len(self.prompts), "data.prompts")
        elif self.source != "file":
            entry = prompt_sources.prompt_source(self.source)
            check_prompts_per_step(self.prompts_per_step, self.generator().num_prompts,
                                   f"data.{entry.section}.num_prompts")

    def generator(self) -> Any:
        """The settings of the generated prompt set ``source`` names (not for ``inline`` / ``file``)."""
        return self.section(prompt_sources.prompt_source(self.source).section)

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


def fork_point(fork_from: str) -> tuple[str, int]:
    """``(run, step)`` of a ``checkpoint.fork_from`` value ``<run>@<step>``; ``ConfigError`` naming the field."""
    run, sep, step = str(fork_from).rpartition("@")
    if not (sep and run and "/" not in run and run not in (".", "..") and step.isdigit()):
        raise field_error(ConfigError, "checkpoint.fork_from", fork_from, "'<run>@<step>', e.g. 'tiny-grpo@16'",
                          "name the parent run (a folder under checkpoint.root) and the step of one of its versions")
    return run, int(step)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where versions live and how many are kept."""

    root: str = "runs"
    """fsspec URL of the store root: a local directory (default) or ``s3://bucket/prefix``."""
    keep_last: int = 3
    """Keep the newest k versions (at least ``async_training.max_policy_lag + 1``: the versions lagged rollouts
    load)."""
    keep_every: int | None = None
    """Also keep every m-th step forever."""
    keep_batches: bool = False
    """Also write each step's trained batch (rollout, rewards, advantages) to ``<root>/<run>/batches/`` (never
    pruned): what ``replay`` and ``rescore`` read (``unirl_core/runs/replay.py``). Replaying step k also needs
    versions k-1 and k: keep them with ``keep_every: 1`` (or a ``keep_last`` of at least ``loop.total_steps``)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``); credentials come from the environment."""
    every_n_steps: int = 1
    """Steps between writes of the full resumable state (optimizer, RNG, counters) and at the last step; the
    weights are a version every step. Above 1 where the trainer stays resident between steps: pool mode and
    ``run_local``; a Flyte workflow in pods mode writes it every step (each train pod restores the previous version's full
    state, ``for_workflow``). A run resumes only from a version with the full state."""
    full_state: Literal["file", "sharded"] = "file"
    """``file``: ``train_state.pt`` in the version (gathered to rank 0, written before the step returns);
    ``sharded``: ``state-<step>/`` per rank via torch.distributed.checkpoint, written asynchronously while the
    next steps run (pool mode; ``unirl_core/checkpoint/sharded.py``)."""
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    """One writer per run: ``<root>/<name>/LEASE``, taken when ``run_local`` or the Flyte init task starts
    writing the run, released at its end; a second execution of the run refuses or waits (``on_held``)."""

    fork_from: str | None = None
    """``<run>@<step>``: start this run as a fork of version ``step`` of run ``<run>`` (under the same ``root``), with
    this config's settings from step ``step + 1`` on (a changed reward, lr, algorithm knob, sampling, ...: what
    ``resume`` refuses a fork may change, except the model). Steps up to ``step`` are not run again: the fork's
    version ``step`` references the parent's files (no copy) and records the lineage; ``name`` must differ from
    ``<run>``. A fork that already exists is continued. ``docs/replay.md`` (Fork)."""

    weights_encoding: Literal["full", "delta"] = "full"
    """How a version's weights are stored (``unirl_core/checkpoint/delta.py``). ``full``: ``model.safetensors`` every
    version. ``delta``: a weights-only version (between full states, ``every_n_steps > 1``) is the zstd-compressed
    bitwise XOR of its bit patterns against the version before it, lossless; a full anchor every ``anchor_every``
    versions and at every full state. A process that writes through a writer (``run_local``, the pool's trainer)
    holds the previous version in host memory (one more copy of the weights); other writers write full versions.
    Engines that hold the delta's base version are sent the delta (``runtime.build.load_policy_weights``)."""
    anchor_every: int = 8
    """With ``weights_encoding: delta``: at most this many versions per chain (a full anchor, then deltas), so a read
    from the store decodes at most ``anchor_every - 1`` deltas on top of one full file. 1 writes every version in
    full."""

    def __post_init__(self) -> None:
        if self.fork_from is not None:
            fork_point(self.fork_from)
        if not (isinstance(self.anchor_every, int) and self.anchor_every >= 1):
            raise field_error(ConfigError, "checkpoint.anchor_every", self.anchor_every, "an integer >= 1",
                              "e.g. 8: a full version, then up to 7 deltas (1 writes every version in full)")
        if self.weights_encoding == "delta" and self.every_n_steps == 1 and self.full_state == "file":
            raise field_error(ConfigError, "checkpoint.weights_encoding", "delta", "'full' while every version holds "
                              "the full state (checkpoint.every_n_steps=1, full_state='file'): a delta is only "
                              "written between full states", "set checkpoint.every_n_steps > 1 (or full_state: "
                              "sharded in pool mode), or weights_encoding: full")

    def full_state_at(self, step: int, total_steps: int) -> bool:
        """Whether version ``step`` holds the full resumable state: every ``every_n_steps``-th and the last."""
        return step % self.every_n_steps == 0 or step >= total_steps

    def for_workflow(self, execution: str) -> CheckpointConfig:
        """This config as a Flyte workflow in ``execution`` mode runs it: in pods mode every train pod restores the
        full state of the version before it, so every version holds it (``every_n_steps`` 1, said once)."""
        if execution == "pool" or self.every_n_steps == 1:
            return self
        logging.getLogger(__name__).warning(
            "checkpoint.every_n_steps=%d applies in run_local and pool.execution='pool'; a Flyte workflow in pods "
            "mode writes the full state every step (each train pod restores it)", self.every_n_steps)
        return dataclasses.replace(self, every_n_steps=1)


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """Length and shape of the training loop."""

    total_steps: int = 8
    """Rollout -> train steps of the whole run."""
    steps_per_chunk: int = 4
    """Steps per @dynamic chunk; chunks are chained so the DAG stays bounded."""
    rollout_shards: int = 1
    """Prompt shards rolled out in parallel (map_task); each shard holds whole groups."""
    seed: int = 0
    """Base seed of the per-step NoiseRecipe and the sampling generators."""
    rollout_with_trainer: bool | None = None
    """In-process runs (``run_local``): the trainside engine samples with the trainer's own module (its compute
    context reads fp32 masters as the model dtype, the rounding a published version gives; ``ema`` rollouts swap
    the trainer's EMA in), so the process holds one copy of the weights instead of two and copies none per step.
    Bitwise the rollout bundle's sampling. The trainer restores the version first when it does not hold it (step 1,
    after a failure). None (default): wherever it applies - not with a dedicated engine, lagged rollouts,
    ``train.shard: always``, ``pool.execution: pool`` (there: ``pool.placement: shared``) or in a Flyte workflow
    (rollout and train are separate tasks); True: required (those are refused); False: always a rollout bundle.
    Evaluation and extra dynamic-sampling rounds still use a rollout bundle."""

    def check_workflow(self) -> None:
        """Refuse what the Flyte workflow cannot honour: its rollout and train phases are separate tasks."""
        if self.rollout_with_trainer is True:
            raise field_error(ConfigError, "loop.rollout_with_trainer", True, "unset or false in a Flyte workflow",
                              "rollout and train are separate tasks there (pods) or actors (pool): use "
                              "pool.placement='shared' for one copy of the weights in the pool, or run_local")

    def __post_init__(self) -> None:
        if self.rollout_with_trainer is not None and not isinstance(self.rollout_with_trainer, bool):
            raise field_error(ConfigError, "loop.rollout_with_trainer", self.rollout_with_trainer,
                              "unset, true or false", "leave it unset (on wherever it applies)")
        check_ints("loop", self, ("total_steps", "steps_per_chunk", "rollout_shards"), "use e.g. 1")


@dataclass(frozen=True, kw_only=True)
class PartialRolloutConfig:
    """LM partial rollouts under a lag (``unirl_core/rollout/partial.py``): the weight update reaches a running
    generation after ``interrupt_at_tokens`` tokens, and the rest of the completion samples with the new version."""

    interrupt_at_tokens: int
    """Tokens sampled with version ``n - 1 - k`` before version ``n - k`` takes over (pinned: runs stay reproducible;
    in a real pool the publication's timing decides)."""
    old_tokens: Literal["mask", "correct"] = "correct"
    """``correct``: the old policy's tokens stay in the loss with their own behaviour log-probs (TIS / MIS weight);
    ``mask``: they leave it."""

    def __post_init__(self) -> None:
        check_ints("async_training.partial_rollout", self, ("interrupt_at_tokens",),
                   "e.g. half of lm.sampling.max_new_tokens")
        if self.old_tokens not in ("mask", "correct"):
            raise field_error(ConfigError, "async_training.partial_rollout.old_tokens", self.old_tokens,
                              "'mask' or 'correct'", "pick one")


@dataclass(frozen=True, kw_only=True)
class AsyncTrainingConfig:
    """Asynchronous (off-policy) training with bounded staleness: rollouts run ahead of training.

    Step ``n`` trains from version ``n - 1``; with ``max_policy_lag: k`` its rollout samples with version
    ``max(0, n - 1 - k)`` (pinned, so runs are reproducible), so rollout ``n + 1`` can run beside train ``n``.
    Same knob elsewhere: verl ``async_training.staleness_threshold``, AReaL ``max_head_offpolicyness``, TRL
    ``max_staleness``. Correct the lag with the loss's ``tis_cap`` / ``mis_bounds`` (``train.old_logp_source:
    replay``; ``docs/algorithms.md``)."""

    max_policy_lag: int = 0
    """k: versions a rollout may lag behind the weights that train it; 0 is the synchronous loop."""
    max_inflight: int | None = None
    """Rollout shards running or queued at once (``run_local``'s rollout manager); None: ``loop.rollout_shards *
    (max_policy_lag + 1)``, every shard admission control allows."""
    overlap: bool = True
    """``run_local``: sample on a worker thread while the driver scores and trains (the rollout and trainer model
    copies are separate); False samples inline (same numbers, no overlap)."""
    partial_rollout: PartialRolloutConfig | None = None
    """LM only: generations continue under the version published while they run (``run_local``); None: off."""

    def __post_init__(self) -> None:
        check_ints("async_training", self, ("max_policy_lag",), "use 0 (synchronous) or e.g. 1", minimum=0)
        if self.max_inflight is not None and not (isinstance(self.max_inflight, int) and self.max_inflight >= 1):
            raise field_error(ConfigError, "async_training.max_inflight", self.max_inflight, "None or an integer >= 1",
                              "leave it unset")

    def check_workflow(self) -> None:
        """Refuse what the Flyte DAG does not run: partial rollouts need the sampler thread of ``run_local``."""
        if self.partial_rollout is not None:
            raise field_error(ConfigError, "async_training.partial_rollout", "set", "unset in the Flyte workflow",
                              "partial rollouts run in run_local only (a rollout pod cannot wait for the next "
                              "publication mid-generation yet); remove the section, the lag itself is wired")

    def rollout_version(self, step: int) -> int:
        """The version whose weights sample the rollout of training step ``step`` (which trains from ``step - 1``)."""
        return max(0, step - 1 - self.max_policy_lag)


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """What a run shows besides checkpoints and the HTML run report (none of it changes what a step computes)."""

    tensorboard: bool = True
    """Write every step's metrics as TensorBoard scalars to ``<checkpoint.root>/<name>/tensorboard``
    (``tensorboard --logdir`` that folder); False writes none."""
    progress: bool = True
    """``run_local``: print each step's progress line, and what the first step's long phases do (model
    build, checkpoint restore, engine start), to stderr; False leaves them to logging at INFO only.
    ``run_local(..., progress=...)`` overrides it. The Flyte tasks always log the progress line."""
    wandb: WandbConfig | None = None
    """Also log every step's metrics to Weights & Biases (``unirl_core/report/wandb_log.py``); None: not."""
    mlflow: MlflowConfig | None = None
    """Also log every step's metrics to MLflow (``unirl_core/report/mlflow_log.py``; ``{}`` follows
    ``MLFLOW_TRACKING_URI`` / ``MLFLOW_EXPERIMENT_NAME``); None: not."""
    index_every_n_steps: int = 10
    """The Flyte report task re-renders the run report's ``index.html`` (~10 SVG charts, sample strips and
    tables) at step 1, every this many steps and at the last step; each step's records, pages and scalars are
    written every step regardless. 1: every step."""

    def __post_init__(self) -> None:
        check_ints("report", self, ("index_every_n_steps",), "use 10 (1 re-renders the charts every step)")

    def renders_index(self, step: int, total_steps: int) -> bool:
        """Whether step ``step``'s report re-renders ``index.html``."""
        return step == 1 or step % self.index_every_n_steps == 0 or step >= total_steps


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run: which family, its model/sampling/loss section, data, reward, advantage, train, checkpoints."""

    name: str
    """Run name: the checkpoint folder under ``checkpoint.root`` and the run-report title."""
    family: Family
    """``diffusion`` (Flow-GRPO) or ``lm`` (GRPO)."""
    diffusion: DiffusionSection | None = None
    """Required for ``family='diffusion'``."""
    lm: LMSection | None = None
    """Required for ``family='lm'``."""
    data: DataConfig
    reward: RewardConfig
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    tracker: StatTrackerConfig | None = None
    """Per-prompt reward statistics across steps (Flow-GRPO); None normalises within the batch's groups."""
    filter_groups: FilterGroupsConfig | None = None
    """DAPO dynamic sampling: drop groups whose rewards are all equal and refill the batch with extra rounds of
    new prompts (``unirl_core/advantage/dynamic_sampling.py``); None: off. Needs ``train.old_logp_source='replay'``."""
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    """Where the phases execute: ``pods`` (default) or a Ray ``pool`` of warm actors (``unirl_core/pool``)."""
    report: ReportConfig = field(default_factory=ReportConfig)
    """TensorBoard scalars and progress lines; never compared on resume."""
    eval: EvalConfig | None = None
    """Held-out evaluation (deterministic sampling, ``eval/*`` metrics) every ``eval.every_n_steps`` and at the
    end (``unirl_core/loop/evaluate.py``); None: none."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Rollouts lagging training by up to ``max_policy_lag`` versions (``docs/execution.md``, lagged rollouts); default synchronous."""
    plugins: tuple[str, ...] = ()
    """Modules imported before this config is checked, registering what the recipe names (prompt sources,
    environments, scorers, presets): e.g. ``[examples.shapes]`` (``unirl_core/plugins.py``)."""

    def __post_init__(self) -> None:
        check_name_and_family(self, "tiny-grpo")
        _check_full_state(self.checkpoint, self.pool)
        self._check_geometry()
        if self.lm is not None:
            check_lm_deployment(self.lm, self.train.old_logp_source)
        check_rollout_seeds(self)
        check_agent_config(self)
        check_eval_config(self)
        self._check_combinations()
        check_pool_features(self)
        check_shared(self)
        check_named(self)
        check_dedicated(self)

    @property
    def section(self) -> DiffusionSection | LMSection:
        return self.diffusion if self.family == "diffusion" else self.lm

    @property
    def rollout_with_trainer(self) -> bool:
        """Whether ``run_local`` samples with the trainer's module (``loop.rollout_with_trainer``; None: wherever
        it applies, see there)."""
        if self.loop.rollout_with_trainer is not None:
            return self.loop.rollout_with_trainer
        return (self.pool.execution != "pool" and self.async_training.max_policy_lag == 0
                and self.train.shard != "always" and (self.lm is None or self.lm.dedicated is None))

    def _check_combinations(self) -> None:
        """Refuse, naming the field, settings that cannot work together: dynamic sampling (it re-slices the batch and
        runs extra rollouts in the driver's process), EMA rollouts (DiffusionNFT's ``old_policy: ema``: the EMA
        must be kept, and the pool's engine actors hold the policy weights only), lagged rollouts (no dynamic
        sampling, corrections that can act) and ``loop.rollout_with_trainer``."""
        algo, lag, fg = self.section.algorithm, self.async_training.max_policy_lag, self.filter_groups is not None
        ema, name = getattr(algo, "rollout_weights", "policy") == "ema", f"{self.family}.algorithm"
        where = f"with async_training.max_policy_lag={lag}"
        corrected = next((k for k in ("tis_cap", "mis_bounds") if getattr(algo, k, None) is not None), None)
        src, rwt = self.train.old_logp_source, self.loop.rollout_with_trainer is True
        with_trainer = "its default with loop.rollout_with_trainer=true"
        keep = ", or set loop.rollout_with_trainer=false"
        refused = [  # (field, value, refused, expected, fix)
            ("train.old_logp_source", src, fg and src != "replay", "'replay' with filter_groups", "refilled batches "
             "mix rollout slices, so pi_old must be replayed over the training micro-batches (the first ratio is "
             "then exactly 1)"),
            ("advantage.drop_zero_std_groups", True, fg and self.advantage.drop_zero_std_groups,
             "False with filter_groups", "filter_groups already drops flat groups and refills the batch; remove it"),
            ("train.ema_decay", None, ema and self.train.ema_decay is None, f"a decay in (0, 1) with "
             f"{name}.old_policy='ema'", f"set train.ema_decay (e.g. 0.9), or {name}.old_policy: policy"),
            ("pool.execution", "pool", ema and self.pool.execution == "pool" and self.pool.placement != "shared",
             f"'pods' with {name}.old_policy='ema'", f"the pool's engine actors sample the policy weights; use "
             f"pool.placement 'shared' (the trainer's EMA), execution 'pods' or {name}.old_policy: policy"),
            ("async_training.max_policy_lag", 0, lag == 0 and self.async_training.partial_rollout is not None,
             ">= 1 with async_training.partial_rollout", "the continuation samples with the next version: set a lag"),
            ("filter_groups", "set", lag > 0 and fg, f"unset {where}",
             "dynamic sampling's refill rounds sample on-policy; remove one of them"),
            (name, algo.name, lag > 0 and ema, f"an algorithm sampling with the policy weights {where}",
             "EMA rollouts are not lagged; use lag 0"),
            ("train.old_logp_source", src, lag > 0 and corrected is not None and src != "replay",
             f"'replay' with {name}.{corrected} {where}", "the behaviour weight is pi_old / pi_behav: pi_old must "
             "be replayed (with 'rollout' it is pi_behav and the weight is 1)"),
            ("pool.execution", self.pool.execution, rwt and self.pool.execution == "pool", with_trainer,
             f"in the pool use pool.placement='shared' (one actor is trainer and engine){keep}"),
            ("async_training.max_policy_lag", lag, rwt and lag > 0, with_trainer, "one module holds one version: "
             f"sample lagged rollouts with the rollout bundle (loop.rollout_with_trainer=false){keep}"),
            ("train.shard", self.train.shard, rwt and self.train.shard == "always", with_trainer,
             f"an FSDP2-sharded module cannot sample: use train.shard 'auto' or 'never'{keep}"),
            ("lm.deployment.engine", self.lm and self.lm.deployment.engine, rwt and self.lm is not None
             and self.lm.dedicated is not None, with_trainer,
             f"a dedicated engine holds its own weights: use the trainside engine{keep}")]
        refuse(refused)
        self._check_partial_rollout()  # with a lag: a partial rollout without one is refused above

    def _check_partial_rollout(self) -> None:
        partial = self.async_training.partial_rollout
        if partial is None:
            return
        field = "async_training.partial_rollout"
        if self.family != "lm" or self.lm.dedicated is not None:
            raise field_error(ConfigError, field, "set", "the trainside LM engine (family lm, deployment direct)",
                              "partial rollouts continue the trainside decoder; remove the section")
        if not self.async_training.overlap:
            raise field_error(ConfigError, "async_training.overlap", False, f"True with {field}",
                              "the continuation waits for the next publication on the sampler thread")
        if not partial.interrupt_at_tokens < self.lm.sampling.max_new_tokens:
            raise field_error(ConfigError, f"{field}.interrupt_at_tokens", partial.interrupt_at_tokens,
                              f"< lm.sampling.max_new_tokens={self.lm.sampling.max_new_tokens}",
                              "interrupt before the token limit")

    def _check_geometry(self) -> None:
        """How the step's samples split into shards and micro-batches. ``train.micro_batch_tokens``: LM only; the
        loop hands it to the trainside engine, whose rescoring packs its rollout shard - the same samples the
        trainer packs only when there is one shard. Recorded log-probs (``old_logp_source: rollout``) are exact only
        over the slices they were sampled in."""
        total, shards, mb, mbt = (self.data.samples_per_step, self.loop.rollout_shards, self.train.micro_batch_size,
                                  self.train.micro_batch_tokens)
        src, fbs, per_shard = self.train.old_logp_source, self.section.engine.forward_batch_size, total // shards
        algo_src = getattr(self.section.algorithm, "old_logp_source", None)
        engine_mbt = self.lm and self.lm.engine.micro_batch_tokens
        refuse([  # (field, value, refused, expected, fix)
            ("loop.rollout_shards", shards, self.data.prompts_per_step % shards,
             f"a divisor of data.prompts_per_step={self.data.prompts_per_step}", "every shard must hold whole groups"),
            ("lm.engine.micro_batch_tokens", engine_mbt, engine_mbt is not None,
             "unset in a run config (the loop passes train.micro_batch_tokens to the engine)",
             "remove it and set train.micro_batch_tokens"),
            ("train.micro_batch_tokens", mbt, mbt is not None and self.family != "lm", "None for family='diffusion'",
             "remove it and use train.micro_batch_size"),
            ("loop.rollout_shards", shards, mbt is not None and src == "rollout" and shards != 1,
             "1 with train.micro_batch_tokens and train.old_logp_source='rollout'", "each shard packs its own "
             "samples, so its recorded log-probs are not over the trainer's micro-batches; use one shard or set "
             "train.old_logp_source='replay'"),
            ("train.micro_batch_size", mb, mbt is None and total % mb, f"a divisor of samples per step ({total})",
             "keep micro-batches equal so every update sees the same geometry"),
            (f"{self.family}.algorithm.old_logp_source", algo_src, algo_src is not None and algo_src != src,
             f"the same as train.old_logp_source ({src!r})",
             "set both to 'rollout' (exact, needs equal slicing) or both to 'replay'"),
            ("train.micro_batch_size", mb, src == "rollout" and mbt is None and (fbs != mb or per_shard % mb),
             f"equal to {self.family}.engine.forward_batch_size ({fbs}) and dividing the samples of one rollout "
             f"shard ({per_shard})", "the stored log-probs are exact only over the same slices; match them or set "
             "train.old_logp_source='replay'"),
            ("advantage.drop_zero_std_groups", True, src == "rollout" and self.advantage.drop_zero_std_groups,
             "False while train.old_logp_source='rollout'",
             "dropping groups re-slices the batch; use old_logp_source='replay' with it"),
            ("reward.failure_policy", "mark_invalid", src == "rollout" and self.reward.failure_policy == "mark_invalid",
             "'fail' while train.old_logp_source='rollout'",
             "excluding invalid samples re-slices the batch; use old_logp_source='replay'"),
            ("train.lr", self.train.lr, not math.isfinite(self.train.lr), "a finite number", "e.g. 1e-4")])


def check_name_and_family(cfg, example: str) -> None:
    """A run name usable as a folder, and exactly the section of ``cfg.family`` (``diffusion`` or ``lm``)."""
    if not cfg.name or "/" in cfg.name:
        raise field_error(ConfigError, "name", cfg.name, "a non-empty run name without '/'", f"e.g. {example}")
    other = "lm" if cfg.family == "diffusion" else "diffusion"
    if getattr(cfg, cfg.family) is None:
        raise field_error(ConfigError, cfg.family, None, f"a '{cfg.family}' section for family={cfg.family!r}",
                          f"add the '{cfg.family}' section to the recipe")
    if getattr(cfg, other) is not None:
        raise field_error(ConfigError, other, "set", f"no '{other}' section for family={cfg.family!r}",
                          f"remove the '{other}' section")


def check_rollout_seeds(cfg: RunConfig) -> None:
    """Refuse engine seeds the loop would replace without a word.

    ``rollout_phase`` seeds every rollout shard with ``stable_seed(loop.seed, 'rollout', step, shard)``: it
    replaces ``<family>.engine.seed`` of the trainside engines and seeds every request of a dedicated
    engine (unless ``lm.sampling.seed`` is set), so the server's own ``lm.vllm.seed`` never draws a sample.
    """
    seeds = [(f"{cfg.family}.engine.seed", cfg.section.engine.seed, type(cfg.section.engine)().seed)]
    if cfg.family == "lm" and cfg.lm.deployment.engine == "vllm" and cfg.lm.vllm is not None:
        seeds.append(("lm.vllm.seed", cfg.lm.vllm.seed, VLLMEngineConfig().seed))
    for name, value, default in seeds:
        if value != default:
            raise field_error(ConfigError, name, value, f"the default {default!r} in a training run (the loop "
                              "seeds each rollout shard with stable_seed(loop.seed, 'rollout', step, shard) instead)",
                              "set loop.seed to change the rollout randomness (for LM runs a set lm.sampling.seed "
                              "takes precedence)")


def _check_full_state(ck: CheckpointConfig, pool: PoolConfig) -> None:
    check_ints("checkpoint", ck, ("every_n_steps",), "use 1")
    if ck.full_state not in ("file", "sharded"):
        raise field_error(ConfigError, "checkpoint.full_state", ck.full_state, "'file' or 'sharded'", "use 'file'")
    if pool.execution != "pool" and ck.full_state != "file":
        raise field_error(ConfigError, "checkpoint.full_state", ck.full_state, f"'file' with pool.execution="
                          f"{pool.execution!r}", "the sharded state is written by the pool's trainer actors; set "
                          "pool.execution='pool' or use 'file'")
