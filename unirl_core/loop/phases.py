"""One library function per loop phase: rollout -> reward -> advantage -> train -> publish.

Each takes the RunConfig plus typed inputs and returns typed outputs and a flat float metrics dict;
Flyte tasks call exactly one of them. ``run_local`` chains the same functions in plain Python.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from unirl_core.advantage.batch import assign_advantages
from unirl_core.advantage.tracker import PerPromptStatTracker
from unirl_core.checkpoint import CheckpointRef, load_checkpoint, restore_train_checkpoint, save_train_checkpoint
from unirl_core.config.loader import to_dict
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, ConfigError, field_error
from unirl_core.loop import build
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.rollout.diffusion import TrainsideDiffusionEngine
from unirl_core.sde.noise import stable_seed
from unirl_core.train.backend import TrainBackend
from unirl_core.types import NoiseRecipe, PromptRecord, SampleBatch

log = logging.getLogger(__name__)

TRACKER_KEY = "unirl.tracker_state"


def init_run(cfg: RunConfig, *, resume_from: str = "latest") -> CheckpointRef:
    """The checkpoint the loop starts from.

    ``resume_from``: ``latest`` resumes the run's published version (or writes a fresh step-0
    version when the run has none), ``never`` requires an empty run, any other value is the URI of
    a version folder of this run.
    """
    store = build.store(cfg)
    if resume_from not in ("latest", "never"):
        found = [r for r in store.versions() if r.uri.rstrip("/") == resume_from.rstrip("/")]
        if not found:
            raise field_error(CheckpointError, "resume_from", resume_from,
                              f"a complete version of run {cfg.name!r} under {store.uri}",
                              f"pick one of {[r.uri for r in store.versions()][-3:]} or 'latest'")
        return found[0]
    latest = store.latest()
    if latest is not None:
        if resume_from == "never":
            raise field_error(ConfigError, "resume_from", "never", f"an empty run, but {store.uri} has step "
                              f"{latest.step}", "pass resume_from='latest' or choose another run name")
        log.info("resuming run %s from step %d (%s)", cfg.name, latest.step, latest.uri)
        return latest
    # a fresh build: the cached bundle may carry another run's trained weights
    backend = TrainBackend(build.fresh_bundle(cfg), build.algorithm(cfg), cfg.train)
    return save_train_checkpoint(store, backend, config=to_dict(cfg), extra={}, publish=True)


def step_prompts(cfg: RunConfig, step: int, shard: int = 0, num_shards: int = 1) -> list[PromptRecord]:
    """Prompts of training step ``step`` (1-based) for one shard; group ids are unique per step."""
    if not (0 <= shard < num_shards) or cfg.data.prompts_per_step % num_shards:
        raise field_error(ConfigError, "shard/num_shards", (shard, num_shards),
                          f"0 <= shard < num_shards dividing prompts_per_step={cfg.data.prompts_per_step}",
                          "set loop.rollout_shards to a divisor of data.prompts_per_step")
    recs = build.dataset(cfg).batch(step - 1, cfg.data.prompts_per_step)
    per = len(recs) // num_shards
    return [PromptRecord(prompt_id=f"s{step:06d}-{r.prompt_id}", prompt=r.prompt, targets=dict(r.targets))
            for r in recs[shard * per:(shard + 1) * per]]


def rollout_phase(cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int = 0,
                  num_shards: int = 1) -> tuple[SampleBatch, dict[str, float]]:
    """Sample one shard of step ``step`` with the weights of ``ckpt`` (trainside engine)."""
    t0 = time.perf_counter()
    policy = build.bundle(cfg)
    build.load_policy_weights(policy, ckpt, cfg)
    seed = stable_seed(cfg.loop.seed, "rollout", step, shard)
    section = cfg.section
    sampling = section.sampling.params() if cfg.family == "diffusion" else section.sampling
    request = SampleBatch.from_prompts(step_prompts(cfg, step, shard, num_shards),
                                       samples_per_prompt=cfg.data.samples_per_prompt, kind=cfg.family
                                       if cfg.family == "diffusion" else "ar", sampling=sampling,
                                       policy_version=ckpt.policy_version,
                                       metadata={"run": cfg.name, "step": str(step), "shard": str(shard)})
    engine_cfg = dataclasses.replace(section.engine, seed=seed % (2**63))
    if cfg.family == "diffusion":
        engine = TrainsideDiffusionEngine(policy, engine_cfg, policy_version=ckpt.policy_version)
        noise = NoiseRecipe(base_seed=seed % (2**63), same_noise_per_group=section.sampling.same_noise_per_group)
        batch = engine.generate(request, noise=noise)
    else:
        engine = TrainsideAREngine(policy, engine_cfg, policy_version=ckpt.policy_version)
        batch = engine.generate(request)
    seconds = time.perf_counter() - t0
    metrics = {"rollout/samples": float(len(batch)), "rollout/seconds": seconds}
    if cfg.family == "lm":
        lens = [p.segment.num_response_tokens for p in batch.generated]
        metrics["rollout/response_tokens_mean"] = sum(lens) / max(len(lens), 1)
        metrics["rollout/tokens_per_s"] = sum(lens) / max(seconds, 1e-9)
    return batch, metrics


def reward_phase(cfg: RunConfig, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
    """Score every sample (per component and weighted total); the failure policy is the config's."""
    scored, stats = build.reward_service(cfg).score_with_stats(batch)
    return scored, stats.as_metrics()


def advantage_phase(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef) -> tuple[SampleBatch, dict[str, float]]:
    """Group-normalised advantages; with a tracker its state is read from ``ckpt`` and carried onward in
    the batch metadata for the train phase to checkpoint."""
    tracker = None
    if cfg.tracker is not None:
        extra = load_checkpoint(ckpt, storage_options=cfg.checkpoint.storage_options, train_state=False).extra
        state = extra.get("tracker")
        tracker = (PerPromptStatTracker.from_state_dict(state, cfg.tracker) if state
                   else PerPromptStatTracker(cfg.tracker))
    out, stats = assign_advantages(batch, cfg.advantage, tracker)
    if tracker is not None:
        out.metadata[TRACKER_KEY] = json.dumps(tracker.state_dict())
    return out, stats.as_metrics()


def train_phase(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *,
                step: int) -> tuple[CheckpointRef, dict[str, float]]:
    """One rollout batch of updates from ``ckpt``; writes (unpublished) version ``step``."""
    if step != ckpt.step + 1:
        raise field_error(CheckpointError, "step", step, f"ckpt.step + 1 = {ckpt.step + 1}",
                          "train each step from the version of the step before it")
    policy = build.bundle(cfg)
    backend = TrainBackend(policy, build.algorithm(cfg), cfg.train)
    loaded = restore_train_checkpoint(backend, ckpt, storage_options=cfg.checkpoint.storage_options)
    metrics = backend.step(batch).as_dict()
    extra = dict(loaded.extra)
    if TRACKER_KEY in batch.metadata:
        extra["tracker"] = json.loads(batch.metadata[TRACKER_KEY])
    # A version `step` can only be a leftover of an interrupted attempt at this same step: replace it.
    ref = save_train_checkpoint(build.store(cfg), backend, config=to_dict(cfg), extra=extra, publish=False,
                                overwrite=True)
    return ref, {f"train/{k}": float(v) for k, v in metrics.items()}


def publish_phase(cfg: RunConfig, ckpt: CheckpointRef) -> dict:
    """Make ``ckpt`` the run's published version (atomic pointer + retention); returns what was published."""
    store = build.store(cfg)
    store.publish(ckpt)
    manifest = load_checkpoint(ckpt, storage_options=cfg.checkpoint.storage_options, train_state=False).manifest
    return {"uri": ckpt.uri, "step": ckpt.step, "policy_version": ckpt.policy_version,
            "files": {name: dict(info) for name, info in manifest.files.items()},
            "bytes": sum(int(info["bytes"]) for info in manifest.files.values())}
