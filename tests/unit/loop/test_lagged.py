"""Lagged rollouts in run_local (async_training.max_policy_lag): reproducible, staleness = lag after warm-up,
the worker thread changes no number, resume re-samples the dropped buffer identically, errors re-raise."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from unirl_core.config import load_recipe
from unirl_core.errors import CheckpointError, ConfigError
from unirl_core.loop import lagged
from unirl_core.runtime import build
from unirl_core.loop.local import run_local

torch.set_num_threads(1)

DECOUPLED = ["train.old_logp_source=replay", "lm.algorithm.tis_cap=2.0", "lm.algorithm.mis_bounds=[0.5, 2.0]"]


def _lm(root, *extra, steps=5, name="lag"):
    return load_recipe("tiny-grpo", [f"checkpoint.root={root}", f"name={name}", f"loop.total_steps={steps}",
                                     "report.tensorboard=false", *DECOUPLED, *extra])


def _numbers(hist):
    return [(h["reward/mean"], h["train/loss"], h.get("train/is_weight_mean")) for h in hist]


@pytest.mark.slow
def test_lag_one_is_reproducible_and_the_thread_changes_no_number(tmp_path):
    a = run_local(_lm(tmp_path / "a", "async_training.max_policy_lag=1"), progress=False)
    b = run_local(_lm(tmp_path / "b", "async_training.max_policy_lag=1"), progress=False)
    inline = run_local(_lm(tmp_path / "c", "async_training.max_policy_lag=1", "async_training.overlap=false"),
                       progress=False)
    assert _numbers(a) == _numbers(b) == _numbers(inline)
    # staleness equals the lag after warm-up (step 1 samples with version 0, the version it trains from)
    assert [h["async/staleness_max"] for h in a] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [h["train/staleness_max"] for h in a] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(h["async/staleness_mean"] == h["async/staleness_max"] for h in a)
    assert [(h["async/staleness_hist/0"], h["async/staleness_hist/1"]) for h in a] == [(1.0, 0.0)] + [(0.0, 1.0)] * 4
    assert all(0.0 <= h["async/engine_idle_frac"] <= 1.0 for h in a[1:]) and "async/engine_idle_frac" not in inline[1]
    # stale batches are corrected (weights != 1); the first update's ratio against the replayed pi_old stays 1
    assert all(h["train/ratio_mean"] == 1.0 for h in a)
    assert a[0]["train/is_weight_mean"] == 1.0 and any(h["train/is_weight_mean"] != 1.0 for h in a[1:])
    assert all(0.0 <= h["train/is_masked_frac"] < 1.0 for h in a)
    # lag changes what is sampled (the same seeds under older weights): the later rewards differ from sync's
    sync = run_local(_lm(tmp_path / "s"), progress=False)
    assert sync[0]["reward/mean"] == a[0]["reward/mean"]  # step 1 samples version 0 either way
    assert [h["reward/mean"] for h in sync[2:]] != [h["reward/mean"] for h in a[2:]]
    assert "async/staleness_max" not in sync[0]


@pytest.mark.slow
def test_resume_resamples_the_dropped_buffer_identically(tmp_path):
    """The manager's buffer is not checkpointed: a resumed run drops it and re-samples the next steps with the
    pinned versions (read back from the store) and the same seeds, so it matches the uninterrupted run."""
    whole = run_local(_lm(tmp_path / "w", "async_training.max_policy_lag=2", "checkpoint.keep_last=3"),
                      progress=False)
    root = tmp_path / "r"
    first = run_local(_lm(root, "async_training.max_policy_lag=2", "checkpoint.keep_last=3", steps=3), progress=False)
    rest = run_local(_lm(root, "async_training.max_policy_lag=2", "checkpoint.keep_last=3"), progress=False)
    assert _numbers(first + rest) == _numbers(whole)
    assert [h["async/staleness_max"] for h in whole] == [0.0, 1.0, 2.0, 2.0, 2.0]

    # partial rollouts too: the first resumed step's continuation reads the next version back from the store
    part = ["async_training.max_policy_lag=2", "checkpoint.keep_last=3", "lm.sampling.max_new_tokens=4",
            "async_training.partial_rollout={interrupt_at_tokens: 2}"]
    whole = run_local(_lm(tmp_path / "pw", *part), progress=False)
    first = run_local(_lm(tmp_path / "pr", *part, steps=3), progress=False)
    rest = run_local(_lm(tmp_path / "pr", *part), progress=False)
    assert _numbers(first + rest) == _numbers(whole)
    assert all("rollout/partial_continued_frac" in h for h in rest)


@pytest.mark.slow
def test_eval_quiesces_the_sampler_and_changes_no_sample(tmp_path, monkeypatch):
    """Eval loads its version into the rollout model the sampler thread uses: the manager is quiesced around it,
    so the training samples equal those of a run without eval. The sampler lingers after loading its weights, so
    an eval that did not wait would overwrite them mid-rollout."""
    real_load = build.load_policy_weights

    def slow_load(policy, ref, cfg, **kw):
        real_load(policy, ref, cfg, **kw)
        if threading.current_thread().name.startswith("rollout"):
            time.sleep(0.3)

    monkeypatch.setattr(build, "load_policy_weights", slow_load)
    plain = run_local(_lm(tmp_path / "p", "async_training.max_policy_lag=1", steps=4), progress=False)
    evald = run_local(_lm(tmp_path / "e", "async_training.max_policy_lag=1", "eval={every_n_steps: 1, num_prompts: 4}",
                          steps=4), progress=False)
    assert _numbers(plain) == _numbers(evald)
    assert all(any(k.startswith("eval/") for k in h) for h in evald)


@pytest.mark.slow
def test_partial_rollouts_continue_under_the_next_version(tmp_path):
    """lag 1, interrupted after 2 of 4 tokens: from step 2 on running completions continue with the version published
    meanwhile (step 1 samples version 0, the only one it may train on, whole); reproducible; masking the old
    tokens changes the loss, not the samples."""
    extra = ["async_training.max_policy_lag=1", "lm.sampling.max_new_tokens=4"]
    part = "async_training.partial_rollout={{interrupt_at_tokens: 2, old_tokens: {}}}"
    a = run_local(_lm(tmp_path / "a", *extra, part.format("correct")), progress=False)
    b = run_local(_lm(tmp_path / "b", *extra, part.format("correct")), progress=False)
    assert _numbers(a) == _numbers(b)
    assert "rollout/partial_continued_frac" not in a[0]
    assert all(h["rollout/partial_continued_frac"] > 0 and 0 < h["rollout/partial_old_token_frac"] < 1 for h in a[1:])
    assert [h["train/staleness_max"] for h in a] == [0.0, 1.0, 1.0, 1.0, 1.0]
    plain = run_local(_lm(tmp_path / "p", *extra), progress=False)
    assert _numbers(plain)[:1] == _numbers(a)[:1] and _numbers(plain)[1:] != _numbers(a)[1:]
    m = run_local(_lm(tmp_path / "m", *extra, part.format("mask")), progress=False)
    assert [h["reward/mean"] for h in m[:2]] == [h["reward/mean"] for h in a[:2]]  # same samples up to step 2
    assert m[0]["train/loss"] == a[0]["train/loss"] and m[1]["train/loss"] != a[1]["train/loss"]


def test_a_failed_rollout_reraises_the_original_error(tmp_path, monkeypatch):
    boom = RuntimeError("engine lost step 2")
    real = lagged.rollout_phase

    def flaky(cfg, ckpt, *, step, **kw):
        if step == 2:
            raise boom
        return real(cfg, ckpt, step=step, **kw)

    monkeypatch.setattr(lagged, "rollout_phase", flaky)
    with pytest.raises(RuntimeError) as info:
        run_local(_lm(tmp_path, "async_training.max_policy_lag=1", steps=3), progress=False)
    assert info.value is boom


def test_retention_keeps_the_versions_a_lag_loads(tmp_path):
    """keep_last below lag + 1 is raised to it (a lagged rollout loads version step - 1 - lag), not refused."""
    cfg = _lm(tmp_path, "async_training.max_policy_lag=2", "checkpoint.keep_last=1", steps=4)
    run_local(cfg, progress=False)
    assert [v.step for v in build.store(cfg).versions()] == [2, 3, 4]


def test_missing_lagged_version_names_keep_last(tmp_path):
    cfg = _lm(tmp_path, "async_training.max_policy_lag=1", steps=2)
    from unirl_core.loop.phases import init_run

    ckpt = init_run(cfg)
    with pytest.raises(CheckpointError, match="checkpoint.keep_last"):
        lagged.lagged_checkpoint(cfg, ckpt, 7)


@pytest.mark.parametrize("extra,field", [
    (["pool.execution=pool", "async_training.partial_rollout={interrupt_at_tokens: 2}"], "async_training.partial_rollout"),
    (["train.old_logp_source=rollout"], "train.old_logp_source"),
    (["filter_groups={max_num_gen_batches: 2}"], "filter_groups"),
    (["async_training.max_policy_lag=-1"], "async_training.max_policy_lag"),
    (["async_training.overlap=false", "async_training.partial_rollout={interrupt_at_tokens: 2}"],
     "async_training.overlap"),
    (["async_training.partial_rollout={interrupt_at_tokens: 4}"], "interrupt_at_tokens"),
    (["async_training.partial_rollout={interrupt_at_tokens: 2, old_tokens: drop}"], "old_tokens"),
])
def test_config_errors_name_the_field(tmp_path, extra, field):
    with pytest.raises(ConfigError, match=field):
        _lm(tmp_path, "async_training.max_policy_lag=1", *extra)


def test_partial_rollout_needs_a_lag(tmp_path):
    with pytest.raises(ConfigError, match="async_training.max_policy_lag"):
        _lm(tmp_path, "async_training.partial_rollout={interrupt_at_tokens: 2}")


@pytest.mark.slow
def test_diffusion_lag_one_trains_with_the_behaviour_weight(tmp_path):
    """Flow-GRPO with lag 1: stale rows skip the 1e-3 rollout-vs-replay check (their gap is drift), fresh ones keep
    it; the behaviour weight is applied and staleness reaches the lag."""
    cfg = load_recipe("tiny-flow-grpo", [
        f"checkpoint.root={tmp_path}", "loop.total_steps=3", "data.samples_per_prompt=4",
        "diffusion.engine.forward_batch_size=4", "train.micro_batch_size=4", "diffusion.sampling.height=32",
        "diffusion.sampling.width=32", "report.tensorboard=false", "async_training.max_policy_lag=1",
        "train.old_logp_source=replay", "diffusion.algorithm.old_logp_source=replay",
        "diffusion.algorithm.tis_cap=2.0"])
    hist = run_local(cfg, progress=False)
    assert [h["train/staleness_max"] for h in hist] == [0.0, 1.0, 1.0]
    assert hist[0]["train/is_weight_mean"] == 1.0 and hist[2]["train/is_weight_mean"] != 1.0
    assert hist[2]["train/logp_absdiff_max"] > 0  # the drift the weight corrects
