"""Where a compose run's phases run: in this process, or on the compose pool's actors (``compose.pool``).

``compose_executor_for(cfg)`` gives the process's executor for the run's mode (``runtime.executor.ProcessExecutors``). The phases (``compose.phases``) hand their work to it and stay the same in both modes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from unirl_core.checkpoint import restore_train_checkpoint
from unirl_core.compose.config import STACKS, ComposeRunConfig, stack_configs
from unirl_core.compose.credit import enhancer_batch, image_batch
from unirl_core.compose.sampling import Refs, sample_step
from unirl_core.runtime import build
from unirl_core.runtime.executor import ProcessExecutors
from unirl_core.runtime.resources import Resources
from unirl_core.runtime.steps import train_and_save
from unirl_core.types import SampleBatch

if TYPE_CHECKING:
    from unirl_core.compose.pool import ComposePoolExecutor

Metrics = dict[str, float]


class ComposeInProcessExecutor:
    """Both stacks in this process. Each stack's rollout bundle and trainer are its own ``Resources``
    (``stacks``)."""

    def __init__(self) -> None:
        self.stacks = {name: Resources() for name in STACKS}

    def policies(self, cfg: ComposeRunConfig, refs: Refs) -> tuple:
        """The enhancer's and the image stack's rollout bundles holding ``refs``' versions (the image stack's EMA
        weights when its algorithm samples with them)."""
        subs = stack_configs(cfg)
        lm_sub, img_sub = subs["enhancer"], subs["image"]
        lm_policy, img_policy = self.stacks["enhancer"].bundle(lm_sub), self.stacks["image"].bundle(img_sub)
        build.load_policy_weights(lm_policy, refs["enhancer"], lm_sub)
        build.load_policy_weights(img_policy, refs["image"], img_sub, ema=build.rollout_weights(img_sub) == "ema")
        return lm_policy, img_policy

    def rollout(self, cfg: ComposeRunConfig, refs: Refs, *, step: int) -> tuple[SampleBatch, Metrics]:
        return sample_step(cfg, *self.policies(cfg, refs), refs, step=step)

    def score(self, cfg: ComposeRunConfig, batch: SampleBatch) -> tuple[SampleBatch, Metrics]:
        scored, stats = build.reward_service(stack_configs(cfg)["image"]).score_with_stats(batch)
        return scored, stats.as_metrics()

    def train(self, cfg: ComposeRunConfig, batch: SampleBatch, refs: Refs, *, step: int) -> tuple[Refs, Metrics]:
        subs = stack_configs(cfg)
        rows = {"enhancer": enhancer_batch(batch), "image": image_batch(batch, cfg.grouping)}
        out, metrics = dict(refs), {}
        for name in cfg.trained:
            ref, sub = refs[name], subs[name]
            t0 = time.perf_counter()
            backend = self.stacks[name].trainer(sub)
            out[name], _, m = train_and_save(  # the stack's version restored every step (its extra JSON: {})
                sub, backend, rows[name], ref, wait=lambda: None, writer=None, background=False, full_state=True,
                hold=lambda: restore_train_checkpoint(backend, ref,
                                                      storage_options=sub.checkpoint.storage_options).extra)
            metrics.update({f"{name}/{k}": v for k, v in m.items() if k.startswith("train/")})
            metrics[f"time/train_{name}"] = time.perf_counter() - t0
        return out, metrics

    def publish_weights(self, cfg: ComposeRunConfig, refs: Refs) -> None:
        """Nothing to push: the next rollout loads the published versions from the store."""


def _pool_executor() -> ComposePoolExecutor:
    """Both stacks on the compose pool's actors (``compose.pool``; imports Ray on first use)."""
    from unirl_core.compose.pool import ComposePoolExecutor

    return ComposePoolExecutor()


PROCESS: ProcessExecutors[ComposeInProcessExecutor | ComposePoolExecutor] = ProcessExecutors(
    ComposeInProcessExecutor, _pool_executor)
"""This process's compose executors."""


def compose_executor_for(cfg: ComposeRunConfig) -> ComposeInProcessExecutor | ComposePoolExecutor:
    """This process's compose executor for ``cfg``'s execution mode."""
    return PROCESS.for_run(cfg)


def compose_in_process() -> ComposeInProcessExecutor:
    """The process's in-process compose executor (evaluation samples with its bundles in every mode)."""
    return PROCESS.in_process()
