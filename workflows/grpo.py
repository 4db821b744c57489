"""The GRPO loop as a Flyte workflow: rollout -> reward -> advantage -> train -> publish, step after step.

    pyflyte run workflows/grpo.py grpo                                   # shapes-flow-grpo-count, local, CPU
    pyflyte run workflows/grpo.py grpo --recipe tiny-grpo --overrides '["loop.total_steps=2"]'
    pyflyte run --remote workflows/grpo.py grpo --recipe sd35m-pickscore  # a cluster with GPUs
    pyflyte run workflows/grpo.py grpo --overrides '["name=b", "checkpoint.fork_from=shapes-flow-grpo-count@32"]'
                                                                         # a fork: steps 33.. only (docs/replay.md)

``grpo_chunk`` is a @dynamic that wires ``loop.steps_per_chunk`` steps and then calls itself for the next
chunk, so no single DAG grows with ``loop.total_steps``. Only wiring lives here; each phase is one task.
"""

from __future__ import annotations

import functools

from flytekit import dynamic, map_task, workflow

from images import train_image
from tasks.advantage import advantage_task
from tasks import resources
from tasks.common import CPU_TASK, chunk_steps
from tasks.dynamic_sampling import dynamic_sampling_task
from tasks.evaluate import eval_task
from tasks.lagged import lagged_version_task
from tasks.publish import publish_task, release_task
from tasks.report import report_task
from tasks.reward import reward_task
from tasks.rollout import join_shards_task, rollout_one_task, rollout_task
from tasks.run_types import ClusterConfig
from tasks.setup import init_task, setup_task
from tasks.train import TRAIN_TASKS
from unirl_core.checkpoint import CheckpointRef
from unirl_core.config import RunConfig
from unirl_core.config.recipes import recipe_names


def sharded_rollout(cfg: RunConfig, ckpt: CheckpointRef, step: int, num_shards: int, pods: dict):
    """The rollout pod pool of ``loop.rollout_shards`` > 1, wired inside the chunk: one mapped task per prompt shard
    (with the recipe's rollout resources), then the shards joined in order (one shard: ``rollout_one_task``, no map
    task and no join)."""
    batches = map_task(functools.partial(rollout_task, cfg=cfg, ckpt=ckpt, step=step, num_shards=num_shards))(
        shard=list(range(num_shards))).with_overrides(**pods)
    return join_shards_task(shards=batches)


@dynamic(container_image=train_image, **CPU_TASK)
def grpo_chunk(cfg: RunConfig, cluster: ClusterConfig, session: str, ckpt: CheckpointRef,
               max_steps: int) -> CheckpointRef:
    """Steps ``ckpt.step + 1 ..``, at most ``loop.steps_per_chunk`` of them; then the next chunk.

    ``max_steps`` > 0 bounds the steps of this execution (scheduled runs); otherwise run to ``loop.total_steps``."""
    first, total = ckpt.step + 1, cfg.loop.total_steps
    budget = total - ckpt.step if max_steps <= 0 else min(max_steps, total - ckpt.step)
    if budget <= 0:
        return release_task(cfg=cfg, ckpt=ckpt)
    last = first + min(chunk_steps(cfg.loop.steps_per_chunk, total), budget) - 1
    shards = cfg.loop.rollout_shards
    # pool mode: the train task is a thin client of the pool's trainer actor, one process whatever the topology
    pool = cfg.pool.execution == "pool"
    train = TRAIN_TASKS[(1, 1) if pool else (cluster.train_nnodes, cluster.train_nproc_per_node)]
    state, prev_report = ckpt, None
    # the recipe's pod resources per role (cluster.rollout / reward / train over its shape's defaults)
    pods = {role: resources.overrides(cfg, cluster, role) for role in ("rollout", "reward", "train")}
    # The published version of each step: step n's rollout samples with version n - 1 - max_policy_lag, so with a
    # lag it depends on that publication only and Flyte runs it beside train n - 1 (lag 0: the previous publish).
    published_at = {ckpt.step: ckpt}
    if ckpt.step == 0 and cfg.eval is not None and cfg.eval.due(0, total):
        # the starting policy: the report's held-out "before"
        prev_report = eval_task(cfg=cfg, ckpt=ckpt).with_overrides(**pods["rollout"])
    for step in range(first, last + 1):
        version = cfg.async_training.rollout_version(step)
        if version not in published_at:  # published before this chunk: read its ref from the store
            published_at[version] = lagged_version_task(cfg=cfg, ckpt=ckpt, version=version)
        if shards == 1:  # one task instead of a map task + join task: one batch file written and read, not two
            joined = rollout_one_task(cfg=cfg, ckpt=published_at[version], step=step).with_overrides(
                **pods["rollout"])
        else:
            joined = sharded_rollout(cfg, published_at[version], step, shards, pods["rollout"])
        scored = reward_task(cfg=cfg, batch=joined.batch).with_overrides(**pods["reward"])
        if cfg.filter_groups is not None:  # DAPO dynamic sampling: flat groups dropped, refilled by extra rounds
            scored = dynamic_sampling_task(cfg=cfg, batch=scored.batch, ckpt=state, step=step,
                                           reward_metrics=scored.metrics).with_overrides(**pods["rollout"])
        adv = advantage_task(cfg=cfg, batch=scored.batch, ckpt=state)
        trained = train(cfg=cfg, batch=adv.batch, ckpt=state, step=step).with_overrides(**pods["train"])
        published = publish_task(cfg=cfg, ckpt=trained.ckpt)
        evaluated = {}  # held-out eval of this step's version; its eval/* metrics join the step's report
        if cfg.eval is not None and cfg.eval.due(step, total):
            evaluated = {"evaluation": eval_task(cfg=cfg, ckpt=published.ckpt).with_overrides(**pods["rollout"])}
        report = report_task(cfg=cfg, session=session, step=step, batch=adv.batch, rollout=joined.metrics,
                             reward=scored.metrics, advantage=adv.metrics, train=trained.metrics,
                             published=published.info, **evaluated)
        if prev_report is not None:
            prev_report >> report  # one writer of index.html at a time
        state, prev_report = published.ckpt, report
        published_at[step] = state
    done = last - first + 1
    if budget > done:
        return grpo_chunk(cfg=cfg, cluster=cluster, session=session, ckpt=state, max_steps=budget - done)
    return release_task(cfg=cfg, ckpt=state)  # the execution's last write: the run's lease goes back


def grpo(recipe: str = "shapes-flow-grpo-count", overrides: list[str] = [],  # noqa: B006 (flytekit copies defaults)
         resume: str = "latest", max_steps: int = 0, fork_as: str = "") -> CheckpointRef:
    """Train a recipe: pyflyte run workflows/grpo.py grpo --recipe tiny-grpo --overrides '["loop.total_steps=4"]'

    Recipes: {recipes}. Each recipe file's first line is the exact command that runs it.

    Overrides that differ from a resumed version's config apply when safe (``train.lr``, ``loop.total_steps``, ...)
    and are refused when they change the trajectory layout (unless forking) or the model.

    Args:
        recipe: a recipe name (above) or the path of your own YAML file.
        overrides: a JSON list of "a.b=value" strings, e.g. '["loop.total_steps=4", "train.lr=1e-4"]'.
        resume: latest (continue the published version; a new run starts at step 0), never (the run must be
            empty), or one version folder of the run (URI or path); an older version needs fork_as.
        max_steps: stop this execution after that many steps (0: run to loop.total_steps).
        fork_as: start a new run of this name from the resume version (the original run is untouched).
    """
    setup = setup_task(recipe=recipe, overrides=overrides)
    start = init_task(cfg=setup.cfg, resume=resume, fork_as=fork_as)
    return grpo_chunk(cfg=start.cfg, cluster=setup.cluster, session=setup.session, ckpt=start.ckpt,
                      max_steps=max_steps)


grpo.__doc__ = grpo.__doc__.format(recipes=", ".join(recipe_names()))  # the library's and the plugins' recipes
grpo = workflow(grpo)
