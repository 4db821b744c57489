"""What both executors run: a step's prompts, sampling with a policy that holds a version, reward shaping,
advantages, and the checks a trainer makes before it replays a batch.

The executors (``runtime.inprocess``, ``pool.executor``) differ in where the state lives - which process holds
the policy, the trainer and the writer - never in what a step computes: they call these functions.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Literal

from unirl_core.advantage.batch import assign_advantages
from unirl_core.advantage.dynamic_sampling import MAX_ROUNDS
from unirl_core.advantage.tracker import PerPromptStatTracker
from unirl_core.algorithms.overlong import apply_overlong_penalty
from unirl_core.checkpoint import (
    CheckpointRef,
    load_manifest,
    load_version_json,
    restore_train_checkpoint,
    save_train_checkpoint,
)
from unirl_core.checkpoint.delta import WeightsMemory
from unirl_core.checkpoint.store import TRAIN_STATE
from unirl_core.checkpoint.writer import VersionWriter
from unirl_core.config.loader import to_dict
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, ConfigError, NumericsError, field_error
from unirl_core.rollout.agentic import AgenticEngine
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.rollout.diffusion import TrainsideDiffusionEngine
from unirl_core.rollout.logp_check import check_logp_agreement, replay_agreement
from unirl_core.rollout.modes import needs_sleep
from unirl_core.rollout.sigma_verify import verify_batch_sigmas, verify_replay_schedule
from unirl_core.runtime import build
from unirl_core.runtime.resources import Resources
from unirl_core.sde.noise import stable_seed
from unirl_core.train.backend import TrainBackend
from unirl_core.types import NoiseRecipe, PromptRecord, SampleBatch

TRACKER_KEY = "unirl.tracker_state"
"""Batch metadata key: the advantage phase's per-prompt tracker state, which the train phase checkpoints."""
EMA_POLICY_VERSION = -2
"""Policy version stamped on Parts sampled with EMA weights: no trainer version ever equals it."""
REFILL_STREAM = 1 << 24
"""Prompt-stream batch index where dynamic sampling's extra rounds start (far past any run's steps)."""


def step_prompts(cfg: RunConfig, step: int, shard: int = 0, num_shards: int = 1,
                 gen_round: int = 0) -> list[PromptRecord]:
    """Prompts of training step ``step`` (1-based) for one shard; group ids are unique per step.

    ``gen_round`` > 0: an extra round of dynamic sampling (``filter_groups``). Its prompts come from a region
    of the prompt stream no regular step reaches (``REFILL_STREAM``), so refilling leaves every step's own
    prompts unchanged; its group ids carry the round."""
    if not (0 <= shard < num_shards) or cfg.data.prompts_per_step % num_shards:
        raise field_error(ConfigError, "shard/num_shards", (shard, num_shards),
                          f"0 <= shard < num_shards dividing prompts_per_step={cfg.data.prompts_per_step}",
                          "set loop.rollout_shards to a divisor of data.prompts_per_step")
    if not (0 <= gen_round < MAX_ROUNDS):
        raise field_error(ConfigError, "gen_round", gen_round, f"0 <= gen_round < {MAX_ROUNDS}",
                          "lower filter_groups.max_num_gen_batches")
    index = step - 1 if gen_round == 0 else REFILL_STREAM + (step - 1) * MAX_ROUNDS + gen_round
    recs = build.dataset(cfg).batch(index, cfg.data.prompts_per_step)
    per = len(recs) // num_shards
    tag = f"s{step:06d}" if gen_round == 0 else f"s{step:06d}r{gen_round}"
    return [PromptRecord(prompt_id=f"{tag}-{r.prompt_id}", prompt=r.prompt, targets=dict(r.targets))
            for r in recs[shard * per:(shard + 1) * per]]


def sample_step(cfg: RunConfig, policy, ckpt: CheckpointRef, *, step: int, shard: int, num_shards: int,
                weights: Literal["policy", "ema"], started: float, resources: Resources,
                gen_round: int = 0, turn_hook=None) -> tuple[SampleBatch, dict[str, float]]:
    """The sampling of ``rollout_phase`` with ``policy`` already holding ``ckpt``'s (or its EMA) weights;
    ``started`` is the ``perf_counter`` the phase began at (``rollout/seconds``); ``resources``: the caller's, whose
    dedicated engine samples when the run has one. ``turn_hook``: agentic rollouts
    of a lagged run (suspension at turn boundaries, ``unirl_core/loop/agent_lagged.py``)."""
    t0 = started
    key = ("rollout", step, shard) if gen_round == 0 else ("rollout", step, shard, "refill", gen_round)
    seed = stable_seed(cfg.loop.seed, *key) % (2**63)
    section = cfg.section
    sampling = section.sampling.params(policy.family, step) if cfg.family == "diffusion" else section.sampling
    version = ckpt.policy_version if weights == "policy" else EMA_POLICY_VERSION
    dedicated = cfg.family == "lm" and cfg.lm.dedicated is not None
    if dedicated and sampling.seed is None:
        # A server draws unseeded requests from its own stream; seed them from the step instead.
        sampling = dataclasses.replace(sampling, seed=seed)
    request = SampleBatch.from_prompts(step_prompts(cfg, step, shard, num_shards, gen_round),
                                       samples_per_prompt=cfg.data.samples_per_prompt, kind=cfg.family
                                       if cfg.family == "diffusion" else "ar", sampling=sampling,
                                       policy_version=version,
                                       metadata={"run": cfg.name, "step": str(step), "shard": str(shard)})
    metrics: dict[str, float] = {}
    if dedicated:
        batch, metrics = _dedicated_rollout(cfg, policy, ckpt, request, where=f"rollout step {step} shard {shard}",
                                            resources=resources)
    elif cfg.family == "diffusion":
        engine_cfg = dataclasses.replace(section.engine, seed=seed)
        engine = TrainsideDiffusionEngine(policy, engine_cfg, policy_version=version)
        noise = NoiseRecipe(base_seed=seed, same_noise_per_group=section.sampling.same_noise_per_group)
        batch = engine.generate(request, noise=noise)
    else:
        engine_cfg = dataclasses.replace(section.engine, seed=seed, micro_batch_tokens=cfg.train.micro_batch_tokens)
        engine = TrainsideAREngine(policy, engine_cfg, policy_version=version)
        batch, agent_metrics = generate_lm(cfg, engine, request, hook=turn_hook)
        metrics.update(agent_metrics)
        if engine.last_decode_rescore_absdiff is not None:
            # How far the KV-cached decode drifts from the full forward (recorded log-probs come from the latter).
            metrics["rollout/decode_rescore_absdiff_max"] = engine.last_decode_rescore_absdiff
        if engine.last_decode_width is not None:
            metrics["rollout/decode_width"] = float(engine.last_decode_width)
    if cfg.family == "diffusion":
        verify_batch_sigmas(batch)  # every engine echoes the schedule it ran; a mismatch fails closed
    seconds = time.perf_counter() - t0
    metrics.update({"rollout/samples": float(len(batch)), "rollout/seconds": seconds})
    if cfg.family == "lm":
        metrics.update(token_rates(batch, seconds))
    return batch, metrics


def generate_lm(cfg: RunConfig, engine, request: SampleBatch, *, hook=None) -> tuple[SampleBatch, dict[str, float]]:
    """``engine``'s completions of ``request``: with ``lm.agent`` multi-turn episodes with the run's environment
    (turns sampled by ``engine``, token ids in and out) and their ``rollout/*`` metrics; else one each, no metrics."""
    if cfg.lm.agent is None:
        return engine.generate(request), {}
    agentic = AgenticEngine(engine, cfg.lm.agent)
    batch = agentic.generate(request, hook=hook)
    return batch, {f"rollout/{k}": v for k, v in agentic.last_metrics.items()}


def token_rates(batch: SampleBatch, seconds: float) -> dict[str, float]:
    """``rollout/response_tokens_mean`` and ``rollout/tokens_per_s`` of an LM batch sampled in ``seconds``."""
    lens = [p.segment.num_response_tokens for p in batch.generated]
    return {"rollout/response_tokens_mean": sum(lens) / max(len(lens), 1),
            "rollout/tokens_per_s": sum(lens) / max(seconds, 1e-9)}


def _dedicated_rollout(cfg: RunConfig, policy, ckpt: CheckpointRef, request: SampleBatch, *, where: str,
                       resources: Resources) -> tuple[SampleBatch, dict[str, float]]:
    """Publish -> engine sync when the served version differs, generate, then engine-vs-replay agreement.

    ``policy`` holds ``ckpt``'s weights: the agreement is measured against exactly what the trainer will replay.
    """
    deployment = cfg.lm.deployment
    slot = resources.dedicated_engine(cfg, policy)
    engine = slot.engine
    if slot.asleep_level:
        engine.wake_up()
    synced, sync_s = slot.needs_sync(ckpt), 0.0
    if synced:
        sync_s = engine.update_weights(slot.publish_source(cfg, policy, ckpt), ckpt.policy_version)
        slot.served_uri = ckpt.uri
        slot.prune_staging()
    slot.asleep_level = 0
    t0 = time.perf_counter()
    batch, agent_metrics = generate_lm(cfg, engine, request)
    generate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    agreement = replay_agreement(policy, batch, micro_batch_size=cfg.train.micro_batch_size)
    metrics = {"rollout/weight_sync_s": sync_s, "rollout/weight_synced": float(synced),
               "rollout/generate_s": generate_s, "rollout/logp_check_s": time.perf_counter() - t0, **agent_metrics,
               **{f"rollout/{k}": v for k, v in agreement.metrics().items()}}
    if needs_sleep(deployment):
        engine.sleep(deployment.sleep_level)
        slot.asleep_level = deployment.sleep_level
    check_logp_agreement(agreement, cfg.lm.logp_check, where=where)
    return batch, metrics


def shape_rewards(cfg: RunConfig, batch: SampleBatch) -> dict[str, float]:
    """Reward shaping the LM algorithm asks for, applied in place to the scored batch: DAPO's overlong
    penalty (``lm.algorithm.overlong_buffer_len``) against ``lm.sampling.max_new_tokens``."""
    algo = cfg.lm.algorithm if cfg.family == "lm" else None
    if getattr(algo, "overlong_buffer_len", None) is None:
        return {}
    return apply_overlong_penalty(batch, max_tokens=cfg.lm.sampling.max_new_tokens,
                                  buffer_len=algo.overlong_buffer_len, penalty_factor=algo.overlong_penalty_factor)


def advantage_step(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *,
                   before_read: Callable[[], None]) -> tuple[SampleBatch, dict[str, float]]:
    """Group-normalised advantages; with a tracker its state is read from ``ckpt`` (after ``before_read``: the
    executor's writes of ``ckpt`` are complete) and carried onward in the batch metadata for the train phase to
    checkpoint."""
    tracker = None
    if cfg.tracker is not None:
        before_read()
        extra = load_version_json(ckpt, "extra.json", storage_options=cfg.checkpoint.storage_options) or {}
        state = extra.get("tracker")
        tracker = (PerPromptStatTracker.from_state_dict(state, cfg.tracker) if state
                   else PerPromptStatTracker(cfg.tracker))
    out, stats = assign_advantages(batch, cfg.advantage, tracker)
    if tracker is not None:
        out.metadata[TRACKER_KEY] = json.dumps(tracker.state_dict())
    return out, stats.as_metrics()


def check_policy_lag(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef) -> None:
    """Refuse a batch sampled by a policy more than the allowed number of versions behind ``ckpt``.

    The bound is ``lm.deployment.sync.max_policy_lag`` for a dedicated LM engine and 0 otherwise (the
    synchronous loop always samples with the version it trains from), or ``async_training.max_policy_lag`` when
    larger (lagged rollouts). EMA rollouts are exempt.
    """
    bound, field = 0, "policy lag (synchronous loop)"
    if cfg.family == "lm" and cfg.lm.dedicated is not None and cfg.lm.deployment.sync is not None:
        bound, field = cfg.lm.deployment.sync.max_policy_lag, "lm.deployment.sync.max_policy_lag"
    if cfg.async_training.max_policy_lag > bound:  # lagged rollouts (unirl_core/loop/lagged.py)
        bound, field = cfg.async_training.max_policy_lag, "async_training.max_policy_lag"
    versions = [p.policy_version for p in batch.generated if p.policy_version != EMA_POLICY_VERSION]
    if not versions:
        return
    lag = ckpt.policy_version - min(versions)
    if lag > bound or max(versions) > ckpt.policy_version:
        raise field_error(NumericsError, field, bound, f"0 <= trainer version - sample version <= {bound}; observed "
                          f"lag {lag} (trainer at version {ckpt.policy_version}, samples from versions "
                          f"{min(versions)}..{max(versions)})",
                          "train each batch from the version that sampled it (or raise the bound for "
                          "asynchronous rollouts); a stale batch optimises a ratio against the wrong policy")


def check_replay_schedule(cfg: RunConfig, batch: SampleBatch, policy) -> None:
    """A diffusion batch's schedules equal, bit for bit, the one the trainer derives from ``cfg`` for ``policy``'s
    family (``verify_replay_schedule``); nothing to check for an LM run."""
    if cfg.family == "diffusion":
        verify_replay_schedule(batch, cfg.diffusion.sampling.sigmas(policy.family))


def restore_full_state(backend: TrainBackend, ckpt: CheckpointRef, cfg: RunConfig) -> dict:
    """Load ``ckpt``'s full state into ``backend``; returns its extra JSON. A version written without it
    (``checkpoint.every_n_steps`` > 1) cannot be trained from: the error names the newest version that can."""
    opts = cfg.checkpoint.storage_options
    if TRAIN_STATE not in load_manifest(ckpt, storage_options=opts).files:
        full = [v for v in build.store(cfg).versions() if v.step <= ckpt.step
                and TRAIN_STATE in load_manifest(v, storage_options=opts).files]
        have = f"step {full[-1].step} ({full[-1].uri})" if full else "none"
        raise field_error(CheckpointError, "checkpoint.every_n_steps", cfg.checkpoint.every_n_steps,
                          f"a full resumable state in {ckpt.uri} (the version this step trains from); the newest "
                          f"version at or before it that has one: {have}",
                          "fork the run from that version (fork_as=..., resume_from=<its step folder>) to retrain "
                          "the steps since; a smaller every_n_steps loses fewer")
    return dict(restore_train_checkpoint(backend, ckpt, storage_options=opts).extra)


def train_and_save(cfg: RunConfig, backend: TrainBackend, batch: SampleBatch, ckpt: CheckpointRef, *,
                   hold: Callable[[], dict], wait: Callable[[], None], writer: VersionWriter | None,
                   background: bool, full_state: bool,
                   memory: WeightsMemory | None = None) -> tuple[CheckpointRef, dict, dict[str, float]]:
    """The train phase's work, in this process (``runtime.inprocess``) or in the pool's trainer actor: ``batch``
    checked (policy lag, replay schedule); ``hold()`` makes ``backend`` hold ``ckpt`` (restoring it when it holds
    another) and returns the version's extra JSON; one update; then, once ``wait()`` saw the previous version's write
    complete, the new version saved unpublished (one of that step can only be a leftover of an interrupted
    attempt at it: replaced), through ``writer`` when given (``background``: the ref returns before the
    thread has written it; else the write is waited for; without a writer, ``memory``: the last version written, a
    delta's base under ``checkpoint.weights_encoding: delta``). Returns the ref, the extra JSON it saved (with the
    advantage tracker's state) and ``train/*``, ``checkpoint/save_s`` (the whole write, or the host snapshot the
    thread writes from) and, ``background``, ``checkpoint/wait_s`` / ``previous_write_s``."""
    check_policy_lag(cfg, batch, ckpt)
    check_replay_schedule(cfg, batch, backend.policy)
    extra = dict(hold())
    metrics = backend.step(batch).as_dict()
    if TRACKER_KEY in batch.metadata:
        extra["tracker"] = json.loads(batch.metadata[TRACKER_KEY])
    t0 = time.perf_counter()
    wait()
    waited = time.perf_counter() - t0
    t1 = time.perf_counter()
    ref = save_train_checkpoint(build.store(cfg), backend, config=to_dict(cfg), extra=extra, publish=False,
                                overwrite=True, writer=writer, full_state=full_state, memory=memory)
    if writer is not None and not background:
        writer.wait()  # the version is complete in the store (or its failure raises)
    out = {f"train/{k}": float(v) for k, v in metrics.items()}
    out["checkpoint/save_s"] = time.perf_counter() - t1
    if background:
        out.update({"checkpoint/wait_s": waited, "checkpoint/previous_write_s": writer.last_seconds})
    return ref, extra, out
