"""A sweep of LoRA runs that share one named Ray pool (``pool.name``): every variant is its own run (its own name,
checkpoints, adapter, optimizer), each a ``grpo`` subworkflow whose phases attach to the pool's warm actors.

    pyflyte run workflows/sweep.py sweep --recipe tiny-grpo --pool_name sweep-a --pool_address <host>:<port> \\
        --overrides '["lm.model.finetune=lora", "loop.total_steps=4"]' \\
        --variants '[["train.lr=1e-3"], ["train.lr=3e-3"]]'

The pool must run (a Ray cluster at ``pool_address``; the first run creates the named pool's actors on it) and the
runs must be LoRA runs of one base model: a full fine-tune naming a pool is refused at setup (``pool.name``). Each
node of the sweep is named ``pool-<pool_name>-<i>``, so the execution graph shows which pool served each run (the
overrides, with ``pool.name``, are each run's inputs too).
"""

from __future__ import annotations

from flytekit import dynamic, workflow

from images import train_image
from tasks.common import CPU_TASK
from unirl_core.checkpoint import CheckpointRef
from workflows.grpo import grpo


def pool_overrides(pool_name: str, pool_address: str) -> list[str]:
    """The overrides that attach a run to the named pool ``pool_name`` of the Ray cluster at ``pool_address``."""
    return ["pool.execution=pool", f"pool.name={pool_name}", f"pool.address={pool_address}",
            "pool.publish=object_store"]


def variant_runs(recipe: str, overrides: list[str], variants: list[list[str]], pool_name: str,
                 pool_address: str) -> list[list[str]]:
    """Each variant's full overrides: the common ones, the pool's, its own name (``<pool_name>-<i>``), its own."""
    return [[*overrides, *pool_overrides(pool_name, pool_address), f"name={pool_name}-{i}", *variant]
            for i, variant in enumerate(variants)]


@dynamic(container_image=train_image, **CPU_TASK)
def sweep_runs(recipe: str, overrides: list[str], variants: list[list[str]], pool_name: str, pool_address: str,
               max_steps: int) -> list[CheckpointRef]:
    return [grpo(recipe=recipe, overrides=run, resume="latest", max_steps=max_steps, fork_as="").with_overrides(
                node_name=f"pool-{pool_name}-{i}")
            for i, run in enumerate(variant_runs(recipe, overrides, variants, pool_name, pool_address))]


@workflow
def sweep(recipe: str, overrides: list[str], variants: list[list[str]], pool_name: str, pool_address: str,
          max_steps: int = 0) -> list[CheckpointRef]:
    """Train one run per variant, all attached to the named pool ``pool_name`` at ``pool_address``.

    Args:
        recipe: a LoRA recipe (or one made LoRA by ``overrides``).
        overrides: a JSON list of "a.b=value" strings every run gets.
        variants: a JSON list of override lists, one run each (named ``<pool_name>-<i>``).
        pool_name: the named pool the runs share (``pool.name``).
        pool_address: ``host:port`` of the Ray cluster that holds it (``pool.address``).
        max_steps: stop each execution after that many steps (0: run to loop.total_steps).
    """
    return sweep_runs(recipe=recipe, overrides=overrides, variants=variants, pool_name=pool_name,
                      pool_address=pool_address, max_steps=max_steps)
