"""One library function per loop phase: rollout -> reward -> advantage -> train -> publish.

Each takes the RunConfig plus typed inputs and returns typed outputs and a flat float metrics dict;
Flyte tasks call exactly one of them. ``run_local`` chains the same functions in plain Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from typing import Literal

import torch.distributed

from unirl_core.advantage.batch import assign_advantages
from unirl_core.advantage.tracker import PerPromptStatTracker
from unirl_core.algorithms.overlong import apply_overlong_penalty
from unirl_core.checkpoint import (
    CheckpointRef,
    load_manifest,
    load_version_json,
    restore_train_checkpoint,
    save_train_checkpoint,
)
from unirl_core.checkpoint.store import TRAIN_STATE
from unirl_core.checkpoint.writer import VersionWriter
from unirl_core.config.loader import to_dict
from unirl_core.config.run import RunConfig
from unirl_core.errors import CheckpointError, ConfigError, NumericsError, field_error
from unirl_core.loop import build
from unirl_core.loop.dynamic_sampling import MAX_ROUNDS, fill_groups
from unirl_core.loop.run_init import init_run  # noqa: F401  (the setup phase, beside the others)
from unirl_core.rollout.agentic import AgenticEngine
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.rollout.diffusion import TrainsideDiffusionEngine
from unirl_core.rollout.logp_check import check_logp_agreement, replay_agreement
from unirl_core.rollout.modes import needs_sleep
from unirl_core.rollout.sigma_verify import verify_batch_sigmas, verify_replay_schedule
from unirl_core.sde.noise import stable_seed
from unirl_core.train.backend import TrainBackend
from unirl_core.train.distributed import current_world
from unirl_core.types import NoiseRecipe, PromptRecord, SampleBatch

log = logging.getLogger(__name__)

TRACKER_KEY = "unirl.tracker_state"
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


def rollout_phase(cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int = 0, num_shards: int = 1,
                  weights: Literal["policy", "ema"] | None = None,
                  gen_round: int = 0, trainer_copy: bool = False) -> tuple[SampleBatch, dict[str, float]]:
    """Sample one shard of step ``step`` with the weights of ``ckpt``: the trainside engine, or the process's
    dedicated engine after syncing ``ckpt`` to it (then checked against the trainer's replay, fail-closed).

    The rollout bundle is the process's own (``build.bundle``), never the trainer's: it holds ``ckpt``'s
    weights in the model dtype, the view the trainer's compute context reproduces. ``weights='ema'`` samples
    with the EMA weights stored in ``ckpt`` (``train.ema_decay`` set), e.g. for evaluation or EMA rollouts;
    such a batch is off-policy for the trainer's first-update check, which only runs on equal versions.
    ``weights=None``: what the run's algorithm samples with (``build.rollout_weights``: ``ema`` for
    DiffusionNFT's default sampling policy, else ``policy``).
    ``gen_round`` > 0: an extra round of dynamic sampling (new prompts and seeds, see ``step_prompts``).
    ``trainer_copy``: when this process's trainer holds exactly ``ckpt`` (it wrote it in its last train phase,
    ``_RESIDENT``), copy the policy weights from it instead of reading the store: the same fp32 values the
    version's file holds, available while the version is still being written (``train_phase(asynchronous=
    True)``). Only for a caller that runs no train phase concurrently (``run_local``'s synchronous loop).

    With ``pool.execution: pool`` the step runs on the pool's engine actor (``unirl_core.pool.phases``).
    """
    weights = weights or build.rollout_weights(cfg)
    if cfg.pool.execution == "pool":
        if gen_round:
            raise field_error(ConfigError, "filter_groups", "set", "unset with pool.execution='pool'",
                              "dynamic sampling runs in pods mode only")
        from unirl_core.pool import phases as pool_phases

        return pool_phases.rollout_phase(cfg, ckpt, step=step, shard=shard, num_shards=num_shards, weights=weights)
    t0 = time.perf_counter()
    if trainer_copy and cfg.loop.rollout_with_trainer and current_world()[1] == 1:
        return _rollout_with_trainer(cfg, ckpt, step=step, shard=shard, num_shards=num_shards, weights=weights,
                                     gen_round=gen_round, started=t0)
    policy = build.bundle(cfg)
    if not (trainer_copy and _copy_resident_weights(policy, ckpt, cfg, weights)):
        finish_writes()  # the version must be in the store before it is read
        build.load_policy_weights(policy, ckpt, cfg, ema=weights == "ema")
    loaded = time.perf_counter() - t0
    batch, metrics = sample_step(cfg, policy, ckpt, step=step, shard=shard, num_shards=num_shards, weights=weights,
                                 started=t0, gen_round=gen_round)
    return batch, {**metrics, "rollout/load_weights_seconds": loaded}


def _rollout_with_trainer(cfg: RunConfig, ckpt: CheckpointRef, *, step: int, shard: int, num_shards: int,
                          weights: Literal["policy", "ema"], gen_round: int,
                          started: float) -> tuple[SampleBatch, dict[str, float]]:
    """``loop.rollout_with_trainer``: sample with the process's trainer module holding ``ckpt`` (restored into it
    first when it holds another state: the first step, or after a failed one), inside its compute context, with
    its EMA swapped in for ``weights='ema'``. No rollout bundle is built; the next train phase finds the trainer
    resident (``_RESIDENT``) and does not restore again."""
    backend = build.trainer(cfg)
    restored = not _holds(_RESIDENT, backend, ckpt, cfg)
    if restored:
        finish_writes()  # ckpt is read from the store
        _RESIDENT.clear()
        extra = _restore(backend, ckpt, cfg)
        files = load_manifest(ckpt, storage_options=cfg.checkpoint.storage_options).files
        _RESIDENT.update(backend=backend, version=(ckpt.uri, ckpt.step, ckpt.policy_version), files=files,
                         extra=dict(extra))
    loaded = time.perf_counter() - started
    with backend.ema_applied() if weights == "ema" else contextlib.nullcontext():
        batch, metrics = sample_step(cfg, backend.policy, ckpt, step=step, shard=shard, num_shards=num_shards,
                                     weights=weights, started=started, gen_round=gen_round)
    return batch, {**metrics, "rollout/load_weights_seconds": loaded, "rollout/with_trainer": 1.0,
                   "rollout/trainer_restored": float(restored)}


def sample_step(cfg: RunConfig, policy, ckpt: CheckpointRef, *, step: int, shard: int, num_shards: int,
                weights: Literal["policy", "ema"], started: float,
                gen_round: int = 0, turn_hook=None) -> tuple[SampleBatch, dict[str, float]]:
    """The sampling of ``rollout_phase`` with ``policy`` already holding ``ckpt``'s (or its EMA) weights;
    ``started`` is the ``perf_counter`` the phase began at (``rollout/seconds``). ``turn_hook``: agentic rollouts
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
        batch, metrics = _dedicated_rollout(cfg, policy, ckpt, request, where=f"rollout step {step} shard {shard}")
    elif cfg.family == "diffusion":
        engine_cfg = dataclasses.replace(section.engine, seed=seed)
        engine = TrainsideDiffusionEngine(policy, engine_cfg, policy_version=version)
        noise = NoiseRecipe(base_seed=seed, same_noise_per_group=section.sampling.same_noise_per_group)
        batch = engine.generate(request, noise=noise)
    else:
        engine_cfg = dataclasses.replace(section.engine, seed=seed, micro_batch_tokens=cfg.train.micro_batch_tokens)
        engine = TrainsideAREngine(policy, engine_cfg, policy_version=version)
        if cfg.lm.agent is not None:  # multi-turn episodes with the run's environment
            agentic = AgenticEngine(engine, cfg.lm.agent)
            batch = agentic.generate(request, hook=turn_hook)
            metrics.update({f"rollout/{k}": v for k, v in agentic.last_metrics.items()})
        else:
            batch = engine.generate(request)
        if engine.last_decode_rescore_absdiff is not None:
            # How far the KV-cached decode drifts from the full forward (recorded log-probs come from the latter).
            metrics["rollout/decode_rescore_absdiff_max"] = engine.last_decode_rescore_absdiff
    if cfg.family == "diffusion":
        verify_batch_sigmas(batch)  # every engine echoes the schedule it ran; a mismatch fails closed
    seconds = time.perf_counter() - t0
    metrics.update({"rollout/samples": float(len(batch)), "rollout/seconds": seconds})
    if cfg.family == "lm":
        lens = [p.segment.num_response_tokens for p in batch.generated]
        metrics["rollout/response_tokens_mean"] = sum(lens) / max(len(lens), 1)
        metrics["rollout/tokens_per_s"] = sum(lens) / max(seconds, 1e-9)
    return batch, metrics


def _dedicated_rollout(cfg: RunConfig, policy, ckpt: CheckpointRef, request: SampleBatch, *,
                       where: str) -> tuple[SampleBatch, dict[str, float]]:
    """Publish -> engine sync when the served version differs, generate, then engine-vs-replay agreement.

    ``policy`` holds ``ckpt``'s weights: the agreement is measured against exactly what the trainer will replay.
    """
    deployment = cfg.lm.deployment
    slot = build.dedicated_engine(cfg, policy)
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
    agent_metrics = {}
    if cfg.lm.agent is not None:  # multi-turn episodes, turns sampled by the server (token ids in and out)
        agentic = AgenticEngine(engine, cfg.lm.agent)
        batch = agentic.generate(request)
        agent_metrics = {f"rollout/{k}": v for k, v in agentic.last_metrics.items()}
    else:
        batch = engine.generate(request)
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


def reward_phase(cfg: RunConfig, batch: SampleBatch) -> tuple[SampleBatch, dict[str, float]]:
    """Score every sample (per component and weighted total); the failure policy is the config's.
    In pool mode the pool's reward actor scores."""
    if cfg.pool.execution == "pool":
        from unirl_core.pool import phases as pool_phases

        scored, metrics = pool_phases.reward_phase(cfg, batch)
    else:
        scored, stats = build.reward_service(cfg).score_with_stats(batch)
        metrics = stats.as_metrics()
    return scored, {**metrics, **shape_rewards(cfg, scored)}


def shape_rewards(cfg: RunConfig, batch: SampleBatch) -> dict[str, float]:
    """Reward shaping the LM algorithm asks for, applied in place to the scored batch: DAPO's overlong
    penalty (``lm.algorithm.overlong_buffer_len``) against ``lm.sampling.max_new_tokens``."""
    algo = cfg.lm.algorithm if cfg.family == "lm" else None
    if getattr(algo, "overlong_buffer_len", None) is None:
        return {}
    return apply_overlong_penalty(batch, max_tokens=cfg.lm.sampling.max_new_tokens,
                                  buffer_len=algo.overlong_buffer_len, penalty_factor=algo.overlong_penalty_factor)


def dynamic_sampling_phase(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *,
                           step: int) -> tuple[SampleBatch, dict[str, float]]:
    """DAPO dynamic sampling between reward and advantage (``filter_groups`` set; else ``batch`` unchanged):
    drop groups whose rewards are all equal and refill with extra rounds of rollout + reward over new prompts
    (``unirl_core.loop.dynamic_sampling.fill_groups``). The result always has ``data.prompts_per_step`` groups."""
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
    tracker = None
    if cfg.tracker is not None:
        finish_writes()
        extra = load_version_json(ckpt, "extra.json", storage_options=cfg.checkpoint.storage_options) or {}
        state = extra.get("tracker")
        tracker = (PerPromptStatTracker.from_state_dict(state, cfg.tracker) if state
                   else PerPromptStatTracker(cfg.tracker))
    out, stats = assign_advantages(batch, cfg.advantage, tracker)
    if tracker is not None:
        out.metadata[TRACKER_KEY] = json.dumps(tracker.state_dict())
    return out, stats.as_metrics()


def train_phase(cfg: RunConfig, batch: SampleBatch, ckpt: CheckpointRef, *, step: int,
                asynchronous: bool = False) -> tuple[CheckpointRef, dict[str, float]]:
    """One rollout batch of updates from ``ckpt``; writes (unpublished) version ``step``.
    In pool mode the pool's trainer actor trains (its optimizer state stays resident between steps).

    ``asynchronous`` (a single-rank process that keeps running, e.g. ``run_local``; never a task pod, whose
    output must be a complete version): the version's files are written on the process's ``VersionWriter``
    thread from a snapshot and the ref returns before the version exists; ``publish_phase(asynchronous=True)``
    moves ``LATEST`` once it does. Every phase that reads the version from the store waits for the write first;
    the next train phase trains from the trainer's resident copy and waits for the write (and its publish) before
    it saves its own version: a failed write raises there, naming the version. In pool mode with one trainer rank
    the trainer actor writes the version on its own thread the same way (``finish_writes`` waits for it)."""
    if step != ckpt.step + 1:
        raise field_error(CheckpointError, "step", step, f"ckpt.step + 1 = {ckpt.step + 1}",
                          "train each step from the version of the step before it")
    if cfg.pool.execution == "pool":
        from unirl_core.pool import phases as pool_phases

        background = asynchronous and cfg.pool.trainer_ranks == 1
        ref, metrics = pool_phases.train_phase(cfg, batch, ckpt, step=step, background=background)
        if background:  # the trainer actor writes it: finish_writes waits for that write too
            _POOL_WRITE.update(cfg=cfg, ref=ref)
        return ref, metrics
    writer = _WRITER if asynchronous and current_world()[1] == 1 else None
    if not (writer and _WRITER.pending(ckpt)):
        finish_writes()  # any other version in flight is complete (or its failure raises) first
    check_policy_lag(cfg, batch, ckpt)
    backend = build.trainer(cfg)
    check_replay_schedule(cfg, batch, backend.policy)
    extra = _resident_extra(backend, ckpt, cfg)
    if extra is None:
        finish_writes()  # ckpt is read from the store
        extra = _restore(backend, ckpt, cfg)
    metrics = backend.step(batch).as_dict()
    if TRACKER_KEY in batch.metadata:
        extra["tracker"] = json.loads(batch.metadata[TRACKER_KEY])
    t0 = time.perf_counter()
    finish_writes()  # version ckpt (written while this step trained) is complete, or its failure raises here
    waited = time.perf_counter() - t0
    # A version `step` can only be a leftover of an interrupted attempt at this same step: replace it.
    t1 = time.perf_counter()
    full = cfg.checkpoint.full_state_at(step, cfg.loop.total_steps)
    ref = save_train_checkpoint(build.store(cfg), backend, config=to_dict(cfg), extra=extra, publish=False,
                                overwrite=True, writer=writer, full_state=full)
    saved = time.perf_counter() - t1  # the whole write, or (writer) the host snapshot the thread writes from
    files = None if writer else load_manifest(ref, storage_options=cfg.checkpoint.storage_options).files
    _RESIDENT.update(backend=backend, version=(ref.uri, ref.step, ref.policy_version), files=files, extra=dict(extra))
    out = {f"train/{k}": float(v) for k, v in metrics.items()}
    out["checkpoint/save_s"] = saved
    if writer is not None:  # the previous version's write on the writer thread, and how long this phase waited
        out.update({"checkpoint/previous_write_s": _WRITER.last_seconds, "checkpoint/wait_s": waited})
    return ref, out


def _restore(backend: TrainBackend, ckpt: CheckpointRef, cfg: RunConfig) -> dict:
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


_RESIDENT: dict[str, object] = {}
"""The version the process's trainer state equals (the one its last train phase wrote: ref and the checksums of
its manifest; None while the writer writes it), and that version's extra JSON: a train phase from exactly that
version in the same process skips the restore (a read of weights and optimizer state it already holds), as the
pool's trainer actor does. Owned by ``train_phase``; ``finish_writes`` fills in the checksums of a version the
writer has finished (or clears it when the write failed)."""

_WRITER = VersionWriter()
"""The process's background version writer (``train_phase(asynchronous=True)``); at most one version in flight."""

_POOL_WRITE: dict[str, object] = {}
"""Pool mode: the config and ref of the last version the pool's trainer actor was asked to write in the background
(``train_phase(asynchronous=True)`` with one trainer rank); ``finish_writes`` waits for that actor's write."""


def finish_writes() -> None:
    """Wait for the version being written in the background (and its publish) - by this process's writer, or in
    pool mode by the trainer actor - and raise its failure. The resident record then gets the checksums the
    version was written with."""
    if _POOL_WRITE:
        from unirl_core.pool import phases as pool_phases

        cfg, ref = _POOL_WRITE.pop("cfg"), _POOL_WRITE.pop("ref")
        pool_phases.wait_written(cfg, ref)
    try:
        _WRITER.wait()
    except CheckpointError:
        _RESIDENT.clear()  # the trainer's state is no version of the store
        raise
    done = _WRITER.last_written()
    if done is not None and _RESIDENT.get("files", {}) is None:
        ref, files = done
        if _RESIDENT.get("version") == (ref.uri, ref.step, ref.policy_version):
            _RESIDENT["files"] = files


def _resident_extra(backend: TrainBackend, ckpt: CheckpointRef, cfg: RunConfig) -> dict | None:
    """``ckpt``'s extra JSON when ``backend`` holds exactly ``ckpt``'s state, else None (restore from the store).
    The manifest is read (not the weights): a version rewritten since, by whoever, has other checksums.
    Cleared first: until this step's version is saved the resident state is no version (a failed step restores)."""
    held = dict(_RESIDENT)
    _RESIDENT.clear()
    if _holds(held, backend, ckpt, cfg):
        return dict(held["extra"])
    return None


def _holds(held: dict, backend: TrainBackend | None, ckpt: CheckpointRef, cfg: RunConfig) -> bool:
    """``held`` (a ``_RESIDENT`` record) says ``backend`` holds exactly ``ckpt``: same ref, same step, and the
    store's manifest has the checksums it was written with (or this process's writer is still writing it)."""
    same = (backend is not None and held.get("backend") is backend and backend.step_count == ckpt.step
            and held.get("version") == (ckpt.uri, ckpt.step, ckpt.policy_version))
    if not same:
        return False
    if _WRITER.pending(ckpt):
        return True
    files = held["files"]
    return files is not None and load_manifest(ckpt, storage_options=cfg.checkpoint.storage_options).files == files


def _copy_resident_weights(policy, ckpt: CheckpointRef, cfg: RunConfig, weights: str) -> bool:
    """Load ``ckpt``'s policy weights into the rollout bundle from the process's trainer when it holds exactly
    that version (single rank, trainside sampling); False when the store must be read instead."""
    if weights != "policy" or current_world()[1] > 1 or (cfg.family == "lm" and cfg.lm.dedicated is not None):
        return False
    backend = _RESIDENT.get("backend")
    if not _holds(_RESIDENT, backend, ckpt, cfg):
        return False
    # device to device: the values model_state_dict() would copy to the host (and the version's file holds),
    # rounded into the rollout dtype by the same copy_; no host round trip of the weights every step
    build.apply_policy_weights(policy, backend.trainable_tensors(), where=f"{ckpt.uri} (the trainer's copy)")
    return True


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


def publish_phase(cfg: RunConfig, ckpt: CheckpointRef, *, asynchronous: bool = False) -> dict:
    """Make ``ckpt`` the run's published version (atomic pointer + retention); returns what was published.

    Inside a multi-rank job (every rank running the loop) rank 0 publishes and the others wait for it.
    In pool mode the trainer's weights then go to the pool's engines in-pool (``pool/*`` entries).
    ``asynchronous``: when ``ckpt`` is still being written by this process's writer (``train_phase(
    asynchronous=True)``) or, in pool mode, by the trainer actor's, that thread publishes it once the manifest is
    written and this returns at once with ``uri`` / ``step`` / ``policy_version`` and ``pending_write: 1`` (no
    ``files`` / ``bytes`` yet; the pool's engines still get the weights in-pool, from the trainer's memory)."""
    pending = {"uri": ckpt.uri, "step": ckpt.step, "policy_version": ckpt.policy_version, "pending_write": 1}
    if asynchronous and cfg.pool.execution != "pool" and _WRITER.publish(ckpt):
        return pending
    if asynchronous and cfg.pool.execution == "pool" and _POOL_WRITE.get("ref") == ckpt:
        from unirl_core.pool import phases as pool_phases

        if pool_phases.publish_when_written(cfg, ckpt):  # the trainer's thread moves LATEST once it is written
            pending.update(pool_phases.publish_weights(cfg, ckpt))  # in-pool: from the trainer's memory
            return pending
    finish_writes()
    store = build.store(cfg)
    rank, world = current_world()
    pool = cfg.pool.execution == "pool"
    if rank == 0:
        store.publish(ckpt, retention=not pool)  # pool: the trainer actor deletes old versions off the step's path
    if world > 1:
        torch.distributed.barrier()
    manifest = load_manifest(ckpt, storage_options=cfg.checkpoint.storage_options)  # no weights read
    published = {"uri": ckpt.uri, "step": ckpt.step, "policy_version": ckpt.policy_version,
                 "files": {name: dict(info) for name, info in manifest.files.items()},
                 "bytes": sum(int(info["bytes"]) for info in manifest.files.values())}
    if pool:
        from unirl_core.pool import phases as pool_phases

        published.update(pool_phases.publish_weights(cfg, ckpt))
        pool_phases.prune_versions(cfg)
    return published
