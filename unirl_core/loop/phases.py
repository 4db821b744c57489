"""One library function per loop phase: rollout -> reward -> advantage -> train -> publish.

Each takes the RunConfig plus typed inputs and returns typed outputs and a flat float metrics dict; Flyte tasks
call exactly one of them, ``run_local`` chains them. Each hands its phase to the process's executor for the run's
mode (``loop.executors.executor_for``: in-process, or the Ray pool); what a step computes is in
``unirl_core.runtime.steps``.
"""

from __future__ import annotations

from typing import Literal

from unirl_core.advantage.dynamic_sampling import fill_groups
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, field_error
from unirl_core.loop.batches import keep_batch
from unirl_core.loop.executors import executor_for, finish_writes  # noqa: F401  (the phases' write barrier)
from unirl_core.loop.run_init import init_run  # noqa: F401  (the setup phase, beside the others)
from unirl_core.runtime import build  # noqa: F401  (what the phases build, for callers that inspect it)
from unirl_core.runtime.steps import (  # noqa: F401  (the step's pieces, for tasks and tools)
    EMA_POLICY_VERSION,
    sample_step,
    shape_rewards,
    step_prompts,
)
from unirl_core.types import SampleBatch


def rollout_phase(cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int = 0, num_shards: int = 1,
                  weights: Literal["policy", "ema"] | None = None,
                  gen_round: int = 0, trainer_copy: bool = False) -> tuple[SampleBatch, dict[str, float]]:
    """Sample one shard of step ``step`` with the weights of ``ckpt``: the trainside engine, or a dedicated
    engine after syncing ``ckpt`` to it (then checked against the trainer's replay, fail-closed).

    The rollout bundle is never the trainer's: it holds ``ckpt``'s weights in the model dtype, the view the
    trainer's compute context reproduces. ``weights='ema'`` samples with the EMA weights stored in ``ckpt``
    (``train.ema_decay`` set), e.g. for evaluation or EMA rollouts; such a batch is off-policy for the trainer's
    first-update check, which only runs on equal versions. ``weights=None``: what the run's algorithm samples with
    (``build.rollout_weights``: ``ema`` for DiffusionNFT's default sampling policy, else ``policy``).
    ``gen_round`` > 0: an extra round of dynamic sampling (new prompts and seeds, see ``step_prompts``).
    ``trainer_copy``: when the executor's trainer holds exactly ``ckpt`` (it wrote it in its last train phase),
    copy the policy weights from it instead of reading the store: the same fp32 values the version's file holds,
    available while the version is still being written (``train_phase(asynchronous=True)``). Only for a caller
    that runs no train phase concurrently (``run_local``'s synchronous loop).
    """
    return executor_for(cfg).rollout(cfg, ckpt, step=step, shard=shard, num_shards=num_shards,
                                     weights=weights or build.rollout_weights(cfg), gen_round=gen_round,
                                     trainer_copy=trainer_copy)


def reward_phase(cfg: RunConfig, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
    """Score every sample (per component and weighted total); the failure policy is the config's. Then the
    reward shaping the algorithm asks for (``shape_rewards``)."""
    scored, metrics = executor_for(cfg).score(cfg, batch)
    return scored, {**metrics, **shape_rewards(cfg, scored)}


def dynamic_sampling_phase(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *,
                           step: int) -> tuple[SampleBatch, dict[str, float]]:
    """DAPO dynamic sampling between reward and advantage (``filter_groups`` set; else ``batch`` unchanged):
    drop groups whose rewards are all equal and refill with extra rounds of rollout + reward over new prompts
    (``unirl_core.advantage.dynamic_sampling.fill_groups``). The result always has ``data.prompts_per_step``
    groups."""
    fg = cfg.filter_groups
    if fg is None:
        return batch, {}
    shards = cfg.loop.rollout_shards

    def more(gen_round: int) -> SampleBatch:
        parts = [rollout_phase(cfg, ckpt, step=step, shard=s, num_shards=shards, gen_round=gen_round)[0]
                 for s in range(shards)]
        return reward_phase(cfg, SampleBatch.concat(parts))[0]

    return fill_groups(batch, more, groups=cfg.data.prompts_per_step, max_rounds=fg.max_num_gen_batches,
                       atol=cfg.advantage.zero_std_atol)


def advantage_phase(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef) -> tuple[SampleBatch, dict[str, float]]:
    """Group-normalised advantages; with a tracker its state is read from ``ckpt`` and carried onward in
    the batch metadata for the train phase to checkpoint."""
    return executor_for(cfg).advantage(cfg, batch, ckpt)


def train_phase(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *, step: int,
                asynchronous: bool = False) -> tuple[CheckpointRef, dict[str, float]]:
    """One rollout batch of updates from ``ckpt``; writes (unpublished) version ``step``.

    ``asynchronous`` (a single-rank process that keeps running, e.g. ``run_local``; never a task pod, whose
    output must be a complete version): the version's files are written on the executor's writer thread from a
    snapshot and the ref returns before the version exists; ``publish_phase(asynchronous=True)`` moves ``LATEST``
    once it does. Every phase that reads the version from the store waits for the write first; the next train
    phase trains from the trainer's resident copy and waits for the write (and its publish) before it saves its own
    version: a failed write raises there, naming the version. In the pool the trainer actor keeps its optimizer
    state resident and, with one rank, writes the version on its own thread the same way."""
    if step != ckpt.step + 1:
        raise field_error(CheckpointError, "step", step, f"ckpt.step + 1 = {ckpt.step + 1}",
                          "train each step from the version of the step before it")
    if cfg.checkpoint.keep_batches:
        keep_batch(cfg, step, batch)
    return executor_for(cfg).train(cfg, batch, ckpt, step=step, asynchronous=asynchronous)


def publish_phase(cfg: RunConfig, ckpt: CheckpointRef, *, asynchronous: bool = False) -> dict:
    """Make ``ckpt`` the run's published version (atomic pointer + retention); returns what was published.

    Inside a multi-rank job (every rank running the loop) rank 0 publishes and the others wait for it. In the pool
    the trainer's weights then go to the pool's engines in-pool (``pool/*`` entries). ``asynchronous``: when
    ``ckpt`` is still being written in the background, the writer publishes it once the manifest is written and
    this returns at once with ``uri`` / ``step`` / ``policy_version`` and ``pending_write: 1`` (no ``files`` /
    ``bytes`` yet; the pool's engines still get the weights in-pool, from the trainer's memory)."""
    return executor_for(cfg).publish(cfg, ckpt, asynchronous=asynchronous)
