"""run_local writes each version on a background thread and samples with the trainer's copy of its weights:
the run equals the pods order (every phase reading its version from the store) bitwise, and a failed write
surfaces at the next step naming the version, with LATEST left on the version before it."""

from __future__ import annotations

import errno

import pytest
import safetensors.torch
import torch

from unirl_core.checkpoint import CheckpointStore, fsio
from unirl_core.config import load_recipe
from unirl_core.errors import CheckpointError
from unirl_core.loop import phases
from unirl_core.loop.executors import in_process
from unirl_core.loop.local import run_local

KEYS = ("train/loss", "train/grad_norm", "train/ratio_mean", "train/ratio_max", "reward/mean")
STEPS = 3


def _cfg(root):
    return load_recipe("tiny-grpo", [f"checkpoint.root={root}", f"loop.total_steps={STEPS}", "report.progress=false",
                                     "train.lr=5e-2", "checkpoint.keep_last=5"])


def _weights(root, step):
    return safetensors.torch.load_file(f"{root}/tiny-grpo/step-{step:08d}/model.safetensors")


def _pods_order(cfg) -> list[dict]:
    """The phases as the Flyte pods run them: the rollout reads the published version from the store, the
    train phase writes its version before it returns, publish moves LATEST before the next step."""
    ckpt = phases.init_run(cfg)
    history = []
    for step in range(1, STEPS + 1):
        batch, metrics = phases.rollout_phase(cfg, ckpt, step=step)
        batch, m = phases.reward_phase(cfg, batch)
        metrics.update(m)
        batch, m = phases.advantage_phase(cfg, batch, ckpt)
        metrics.update(m)
        ckpt, m = phases.train_phase(cfg, batch, ckpt, step=step)
        metrics.update(m)
        assert CheckpointStore(cfg.checkpoint.root, cfg.name).versions()[-1] == ckpt  # complete on return
        phases.publish_phase(cfg, ckpt)
        history.append(metrics)
    return history


@pytest.mark.slow
def test_background_versions_equal_the_pods_order(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    reads = []
    real = phases.build.load_policy_weights

    def counting(policy, ref, cfg, **kw):
        reads.append((cfg.checkpoint.root, ref.step))
        return real(policy, ref, cfg, **kw)

    monkeypatch.setattr(phases.build, "load_policy_weights", counting)
    background = run_local(_cfg(tmp_path / "bg"))
    pods = _pods_order(_cfg(tmp_path / "pods"))
    bg, pd = str(tmp_path / "bg"), str(tmp_path / "pods")
    # run_local samples with the trainer's module (loop.rollout_with_trainer's default), so it loads no version into
    # a rollout bundle (the trainer restores step 0 once); the pods order loads every one
    assert [s for r, s in reads if r == bg] == [] and [s for r, s in reads if r == pd] == [0, 1, 2]
    assert all("checkpoint/wait_s" in h for h in background)  # the versions were written in the background
    assert any(h["train/grad_norm"] > 0 for h in pods)
    for a, b in zip(background, pods, strict=True):
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS]
        assert a["train/ratio_max"] == 1.0 == a["train/ratio_min"]  # exact first-update ratio
    store, pods_store = (CheckpointStore(str(tmp_path / d), "tiny-grpo") for d in ("bg", "pods"))
    assert store.latest().step == STEPS and [r.step for r in store.versions()] == list(range(STEPS + 1))
    for a, b in zip(store.versions(), pods_store.versions(), strict=True):
        # versions 1..STEPS-1 were written while the next step trained: each holds its own step's state
        va, vb = store.load(a), pods_store.load(b)
        assert va.weights.keys() == vb.weights.keys() and all(torch.equal(va.weights[k], vb.weights[k])
                                                              for k in va.weights)
        oa, ob = va.train_state["optimizer"]["state"], vb.train_state["optimizer"]["state"]
        assert oa.keys() == ob.keys() and all(torch.equal(oa[n][k], ob[n][k]) for n in oa for k in oa[n])
        assert va.train_state["counters"] == vb.train_state["counters"] == {"step": a.step, "optimizer_steps": a.step,
                                                                            "world_size": 1}


@pytest.mark.slow
def test_a_failed_background_write_surfaces_at_the_next_step(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    real = fsio.write_local

    def disk_full_at_step_2(path, pieces, **kw):
        if "step-00000002" in path:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, pieces, **kw)

    monkeypatch.setattr(fsio, "write_local", disk_full_at_step_2)
    with pytest.raises(CheckpointError, match=r"step-00000002.*writing failed in the background.*No space left"):
        run_local(_cfg(tmp_path / "a"))
    monkeypatch.undo()
    store = CheckpointStore(str(tmp_path / "a"), "tiny-grpo")
    assert store.latest().step == 1 and [r.step for r in store.versions()] == [0, 1]
    assert not (tmp_path / "a" / "tiny-grpo" / "step-00000002" / "manifest.json").exists()
    assert not in_process().resident  # the trainer's state is no version of the store any more
    rest = run_local(_cfg(tmp_path / "a"))  # resumes from the published step 1
    full = run_local(_cfg(tmp_path / "b"))
    assert [h["step"] for h in rest] == [2.0, 3.0]
    assert [[h[k] for k in KEYS] for h in rest] == [[h[k] for k in KEYS] for h in full[1:]]
    wa, wb = _weights(tmp_path / "a", STEPS), _weights(tmp_path / "b", STEPS)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
