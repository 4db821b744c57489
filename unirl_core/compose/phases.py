"""The phases of a compose run: init -> rollout (both Parts) -> score (reward, propagation, advantages) -> train
(both stacks) -> publish (both stacks). Flyte tasks call one each; ``compose.local.run_compose_local`` chains them.

Each stack is a single-family ``RunConfig`` (``compose.config.stack_configs``) with its own store under
``<checkpoint.root>/<name>/<stack>``; the single-family loop's pieces do the work (``Resources.bundle`` /
``build.load_policy_weights`` for sampling, ``TrainBackend`` + the crash-safe checkpoint functions for training,
``loop.phases.init_run`` / ``publish_phase`` for versions). A step writes both trained stacks' versions before it
publishes either, so an interrupted publication is completed (rolled forward) by the next ``init_stacks``.
"""

from __future__ import annotations

import logging

from unirl_core.checkpoint import CheckpointRef, CheckpointStore, save_train_checkpoint
from unirl_core.compose.config import ENHANCER_REFERENCE, STACKS, ComposeRunConfig, stack_configs
from unirl_core.compose.credit import assign_compose_advantages, propagate_rewards
from unirl_core.compose.executor import compose_executor_for
from unirl_core.compose.sampling import Refs
from unirl_core.compose.warm_start import warm_start_enhancer
from unirl_core.config.loader import to_dict
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, ConfigError, field_error
from unirl_core.runtime import build
from unirl_core.loop.batches import keep_batch
from unirl_core.loop.phases import init_run, publish_phase
from unirl_core.train.backend import TrainBackend
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

def init_stacks(cfg: ComposeRunConfig, *, resume_from: str = "latest") -> Refs:
    """Each stack's published version, or a fresh step-0 version (the enhancer warm-started when configured).

    ``resume_from``: ``latest`` or ``never`` (an empty run). Trained stacks must stand at one step; a trained stack
    one step behind whose version of the leader's step is complete but unpublished (a stop between the two
    publications) is published now; any other disagreement is refused."""
    if resume_from not in ("latest", "never"):
        raise field_error(ConfigError, "resume_from", resume_from, "'latest' or 'never' in a compose run",
                          "named versions and forks are not wired for compose runs")
    subs = stack_configs(cfg)
    refs: Refs = {}
    for name in STACKS:
        sub = subs[name]
        if name == "enhancer" and cfg.enhancer.warm_start.steps and build.store(sub).latest() is None:
            refs[name] = _fresh_enhancer(cfg, sub)
        else:
            refs[name] = init_run(sub, resume_from=resume_from)
    return _roll_forward(cfg, subs, refs)


def _fresh_enhancer(cfg: ComposeRunConfig, sub: RunConfig) -> CheckpointRef:
    """Warm-start the enhancer and write its step-0 version; with a KL term (``sub.lm.model.reference`` set) first
    the same weights as the run's KL reference (outside the stack's store, so retention never removes it)."""
    bundle = build.fresh_bundle(sub)
    warm_start_enhancer(bundle, build.dataset(sub).records, cfg.enhancer.warm_start, sub.lm.engine)
    backend = TrainBackend(bundle, build.algorithm(sub), sub.train)
    if sub.lm.model.reference is not None:
        reference = CheckpointStore(cfg.run_root, ENHANCER_REFERENCE, storage_options=sub.checkpoint.storage_options)
        reference.save(0, weights=backend.model_state_dict(), policy_version=0, config=to_dict(sub), publish=True,
                       overwrite=True)  # a stop before the step-0 version below writes both again
    return save_train_checkpoint(build.store(sub), backend, config=to_dict(sub), extra={}, publish=True)


def _roll_forward(cfg: ComposeRunConfig, subs: dict[str, RunConfig], refs: Refs) -> Refs:
    trained = cfg.trained
    lead = max(refs[s].step for s in trained)
    for name in trained:
        ref = refs[name]
        if ref.step == lead:
            continue
        store = build.store(subs[name])
        ahead = [v for v in store.versions() if v.step == lead]
        if ref.step == lead - 1 and ahead:
            log.warning("stack %s: publishing its complete version of step %d (the run stopped between the two "
                        "publications)", name, lead)
            store.publish(ahead[0])
            refs[name] = ahead[0]
            continue
        steps = {s: refs[s].step for s in trained}
        raise field_error(CheckpointError, f"{name} stack version", steps, "trained stacks at one step",
                          f"the stores under {cfg.run_root} disagree; remove the newer versions of the stack ahead "
                          "(or start a new run name)")
    for name in STACKS:
        if name not in trained and refs[name].step != 0:
            raise field_error(CheckpointError, f"{name}.frozen", True, f"a {name} store at step 0",
                              f"the {name} stack was trained before ({refs[name].uri}); a frozen stack samples its "
                              "step-0 version: start a new run name")
    return refs


def step_of(cfg: ComposeRunConfig, refs: Refs) -> int:
    """The run's step: that of its trained stacks."""
    return refs[cfg.trained[0]].step


def rollout_phase(cfg: ComposeRunConfig, refs: Refs, *, step: int) -> tuple[SampleBatch, dict[str, float]]:
    """Sample step ``step``: enhancements with the enhancer's version, their images with the image stack's (its
    EMA weights when its algorithm samples with them, e.g. DiffusionNFT). One SampleBatch, both Parts filled.
    In the pool the engine actor samples and this returns its projection."""
    return compose_executor_for(cfg).rollout(cfg, refs, step=step)


def score_phase(cfg: ComposeRunConfig, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
    """Score every image against its original prompt, propagate to the enhancements, advantages per stack."""
    scored, metrics = compose_executor_for(cfg).score(cfg, batch)
    metrics.update(propagate_rewards(scored))
    metrics.update(assign_compose_advantages(scored, cfg.grouping, cfg.advantage))
    return scored, metrics


def train_phase(cfg: ComposeRunConfig, batch: SampleBatch, refs: Refs, *,
                step: int) -> tuple[Refs, dict[str, float]]:
    """One update of every trained stack on its projection of ``batch``; writes (unpublished) version ``step`` of
    each. A frozen stack keeps its ref. Each stack restores its own full state (weights, optimizer, RNG) first."""
    for name in cfg.trained:
        if step != refs[name].step + 1:
            raise field_error(CheckpointError, f"{name} step", step, f"{name} ckpt.step + 1 = {refs[name].step + 1}",
                              "train each step from the versions of the step before it")
    if cfg.checkpoint.keep_batches:  # the step's batch beside the stacks' versions, for re-scoring
        keep_batch(cfg, step, batch)
    return compose_executor_for(cfg).train(cfg, batch, refs, step=step)


def publish_stacks(cfg: ComposeRunConfig, refs: Refs) -> Refs:
    """Publish every trained stack's version (after all were written: see the module docstring), then hand the
    weights to the engines that sample with them (in the pool: in-pool from the trainers)."""
    subs = stack_configs(cfg)
    for name in cfg.trained:
        publish_phase(subs[name], refs[name])
    compose_executor_for(cfg).publish_weights(cfg, refs)
    return refs
