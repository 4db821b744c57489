"""In one process the train phase skips restoring the version its trainer already holds; the run is unchanged."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from unirl_core.config import load_recipe
from unirl_core.loop import phases
from unirl_core.loop.executors import in_process
from unirl_core.runtime import steps
from unirl_core.runtime.inprocess import InProcessExecutor
from unirl_core.loop.local import run_local

KEYS = ("train/loss", "train/grad_norm", "train/ratio_mean", "reward/mean")


def _run(root, monkeypatch, *, force_restore: bool):
    restores = []
    real = steps.restore_train_checkpoint

    def counting(backend, ref, **kw):
        restores.append(ref.step)
        return real(backend, ref, **kw)

    monkeypatch.setattr(steps, "restore_train_checkpoint", counting)
    if force_restore:
        monkeypatch.setattr(InProcessExecutor, "_resident_extra", lambda self, backend, ckpt, cfg: None)
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={root}", "loop.total_steps=4", "report.progress=false",
                                    "train.lr=5e-2"])
    history = run_local(cfg)
    weights = safetensors.torch.load_file(f"{root}/tiny-grpo/step-00000004/model.safetensors")
    monkeypatch.undo()
    return history, weights, restores


@pytest.mark.slow
def test_resident_trainer_skips_the_restore_and_trains_identically(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    h_skip, w_skip, r_skip = _run(tmp_path / "skip", monkeypatch, force_restore=False)
    h_full, w_full, r_full = _run(tmp_path / "full", monkeypatch, force_restore=True)
    # the trainer's module samples (loop.rollout_with_trainer's default): step 1's rollout restores version 0 into
    # it; after that, the resident trainer reads nothing, the forced one restores before every train step
    assert r_full == [0, 0, 1, 2, 3] and r_skip == [0]
    assert any(h["train/grad_norm"] > 0 for h in h_full)
    for a, b in zip(h_skip, h_full):
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS]
    assert w_skip.keys() == w_full.keys() and all(torch.equal(w_skip[k], w_full[k]) for k in w_skip)


def test_a_failed_step_forgets_the_resident_version(tmp_path, monkeypatch):
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=1", "report.progress=false"])
    run_local(cfg)
    assert in_process().resident
    backend = in_process().resources.trainer(cfg)
    ckpt = phases.build.store(cfg).latest()
    assert in_process()._resident_extra(backend, ckpt, cfg) is not None
    assert not in_process().resident and in_process()._resident_extra(backend, ckpt, cfg) is None  # cleared until the next save


def test_a_rewritten_version_is_restored(tmp_path):
    """Same ref, other content (another writer replaced the version): the manifest checksums differ -> restore."""
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=1", "report.progress=false"])
    run_local(cfg)
    backend = in_process().resources.trainer(cfg)
    ckpt = phases.build.store(cfg).latest()
    held = dict(in_process().resident)
    in_process().resident.update(held, files={**held["files"], "model.safetensors": {"bytes": 0, "sha256": "0" * 64}})
    assert in_process()._resident_extra(backend, ckpt, cfg) is None
