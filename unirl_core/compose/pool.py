"""A compose run in the pool (``pool.execution: pool``): the composed rollout on one engine actor holding both
rollout bundles, the image's reward on the reward actor, each trained stack on a trainer actor of its own with its
optimizer state resident, and each stack's published weights sent trainer -> engine through Ray's object store.

Roles (``ComposePool.make_roles``): ``engine-0`` (``ComposeEngineActor``, the compose config), ``enhancer-trainer``
/ ``image-trainer`` (the pool's ``TrainerActor``, built from the stack's own ``RunConfig``: one per trained stack),
``reward-0`` (``RewardActor`` over the image stack's reward). The engine keeps each step's stack rows (the full
trajectories, ``enhancer_batch`` / ``image_batch`` of the composed batch, in the engines' order) in the object
store; the phase returns the projection, the driver propagates rewards and computes advantages on it, and each
trainer copies them onto its full rows (``pool.projection.for_training``, fail-closed on differing log-probs).
The two trainers train the step concurrently. ``ComposePoolExecutor`` is the compose phases' executor in this mode
(``compose.executor``). Ray is imported on first use only.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from unirl_core.checkpoint import CheckpointRef
from unirl_core.compose.config import STACKS, ComposeRunConfig, stack_configs
from unirl_core.compose.credit import enhancer_batch, image_batch
from unirl_core.errors import PoolActorDied
from unirl_core.runtime import build
from unirl_core.pool import actors, group
from unirl_core.pool.cluster import REWARD, Pool, _Role, close_pool, engine_name
from unirl_core.pool.phases import held_or_sampled
from unirl_core.config.pool import PoolConfig
from unirl_core.pool.projection import project
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

ENGINE = engine_name(0)
Refs = dict[str, CheckpointRef]


def trainer_name(stack: str) -> str:
    return f"{stack}-trainer"


class ComposeEngineActor(actors._Actor):
    """Both rollout bundles (enhancer LM, image model), each labelled with the version it holds; samples a step
    with ``compose.sampling.sample_step`` (the in-process phase's code) and keeps its stack rows for the trainers."""

    def __init__(self, cfg: ComposeRunConfig, name: str, threads: int) -> None:
        super().__init__(cfg, name, threads)
        self.subs = stack_configs(cfg)
        self.policies = {s: self.resources.bundle(self.subs[s]) for s in STACKS}
        self.served: dict[str, actors.Version | None] = dict.fromkeys(STACKS)
        self._rows: dict[tuple[int, str], object] = {}  # (step, stack) -> ObjectRef of the full rows

    def served_version(self, stack: str) -> actors.Version | None:
        return self.served[stack]

    def load_weights(self, stack: str, weights: dict, ckpt: CheckpointRef) -> float:
        """In-pool publication of stack ``stack``'s version ``ckpt`` (rounded into the bundle's dtype on copy, as a
        load from the store); returns its seconds."""
        t0 = time.perf_counter()
        self.served[stack] = None
        build.apply_policy_weights(self.policies[stack], weights, where=f"{self.name} <- {stack} ({ckpt.uri})")
        self.served[stack] = actors._version(ckpt)
        return time.perf_counter() - t0

    def rollout(self, refs: Refs, step: int, emit: str) -> tuple[SampleBatch, dict[str, float]]:
        """Sample step ``step`` with ``refs``' versions (from the store for a stack the pool has not published
        here); keeps the step's stack rows in the object store, returns the projection (``emit: full``: all)."""
        import ray

        from unirl_core.compose.sampling import sample_step

        from_store = 0
        for stack in STACKS:
            if self.served[stack] != actors._version(refs[stack]):
                self.served[stack] = None
                build.load_policy_weights(self.policies[stack], refs[stack], self.subs[stack])
                self.served[stack] = actors._version(refs[stack])
                from_store += 1
        batch, metrics = sample_step(self.cfg, self.policies["enhancer"], self.policies["image"], refs, step=step)
        rows = {"enhancer": enhancer_batch(batch), "image": image_batch(batch, self.cfg.grouping)}
        self._rows = {(step, s): ray.put(rows[s]) for s in self.cfg.trained}  # the synchronous loop: one step
        metrics["pool/stacks_loaded_from_store"] = float(from_store)
        return (batch if emit == "full" else project(batch)), metrics

    def rows_ref(self, step: int, stack: str) -> list | None:
        """``[ObjectRef]`` of stack ``stack``'s full rows of step ``step``, or None when this engine lost them."""
        ref = self._rows.get((step, stack))
        return None if ref is None else [ref]


class ComposePool(Pool):
    """The run's actors (see the module docstring); placement, calls and failures as ``pool.cluster.Pool``."""

    def make_roles(self) -> list[_Role]:
        p = self.pcfg
        roles = [_Role(ENGINE, ComposeEngineActor, p.engine, "pool.engine")]
        roles += [_Role(trainer_name(s), actors.TrainerActor, p.trainer, "pool.trainer") for s in self.cfg.trained]
        return [*roles, _Role(REWARD, actors.RewardActor, p.reward, "pool.reward")]

    def actor_config(self, name: str):
        if name == ENGINE:
            return self.cfg
        stack = "image" if name == REWARD else name.removesuffix("-trainer")
        # the stack's own run config (pods: its phases never dispatch to a pool of their own); the hook is the run's
        return dataclasses.replace(stack_configs(self.cfg)[stack],
                                   pool=PoolConfig(worker_setup_hook=self.cfg.pool.worker_setup_hook))


def close_compose_pool() -> None:
    """Close the process's compose pool, if any (idempotent)."""
    close_pool(ComposePool)


class ComposePoolExecutor:
    """Both stacks on the compose pool's actors (see the module docstring); ``compose.executor`` makes it on first
    use, so ``run_compose_local`` and the Flyte tasks run either mode unchanged."""

    def rollout(self, cfg: ComposeRunConfig, refs: Refs, *, step: int) -> tuple[SampleBatch, dict[str, float]]:
        """The composed rollout on the engine actor; returns the projection (``pool.emit``) and the metrics."""
        return ComposePool.get(cfg).call(ENGINE, "rollout", refs, step, cfg.pool.emit,
                                         what=f"composed rollout step {step}")

    def score(self, cfg: ComposeRunConfig, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
        """Score the images of the projection on the reward actor (the scores come back, not the images)."""
        scores, metrics = ComposePool.get(cfg).call(REWARD, "score", batch, what=f"reward of {len(batch)} images")
        return actors.apply_scores(batch, scores), metrics

    def train(self, cfg: ComposeRunConfig, batch: SampleBatch, refs: Refs, *,
              step: int) -> tuple[Refs, dict[str, float]]:
        """Both trained stacks' updates of step ``step``, concurrently, each on its trainer actor from its full rows
        with ``batch``'s (the scored projection's) rewards and advantages; writes each stack's (unpublished) version."""
        pool = ComposePool.get(cfg)
        t0 = time.perf_counter()
        scored = {"enhancer": enhancer_batch(batch), "image": image_batch(batch, cfg.grouping)}
        calls, resampled = [], 0
        for stack in cfg.trained:
            full, again = held_or_sampled(pool, ENGINE, ("rows_ref", step, stack), (refs, step, "projection"),
                                          what=f"train step {step}: fetching the {stack} rows")
            resampled += again
            calls.append((trainer_name(stack), pool.remote(trainer_name(stack), "train", refs[stack], step,
                                                           scored[stack], *full)))
        results = group.wait_all(pool, calls, what=f"train step {step}")
        out, metrics = dict(refs), {"pool/resampled_rows": float(resampled)}
        for stack, (ref, m) in zip(cfg.trained, results):
            out[stack] = ref
            for k, v in m.items():  # "train/x" -> "<stack>/train/x", "pool/trainer_restored" -> "pool/<stack>_..."
                metrics[f"{stack}/{k}" if k.startswith("train/") else k.replace("pool/", f"pool/{stack}_")] = v
        metrics["time/train_stacks"] = time.perf_counter() - t0
        return out, metrics

    def publish_weights(self, cfg: ComposeRunConfig, refs: Refs) -> dict[str, float]:
        """After the stacks' versions are published in the store: each trained stack's weights from its trainer to
        the engine through the object store. A dead actor or a trainer holding another version is not an error: the
        engine loads a version it does not serve from the store before its next rollout."""
        pool = ComposePool.get(cfg)
        out: dict[str, float] = {}
        for stack in cfg.trained:
            ckpt, what = refs[stack], f"publish {stack} v{refs[stack].policy_version}"
            try:
                weights = pool.call(trainer_name(stack), "weights", ckpt, what=what)
                if weights:
                    out[f"pool/{stack}_publish_s"] = pool.call(ENGINE, "load_weights", stack, weights[0], ckpt,
                                                               what=what)
            except PoolActorDied as e:
                log.warning("pool: in-pool publication of %s skipped (%s); the engine loads it from the store",
                            ckpt.uri, e)
        return out
