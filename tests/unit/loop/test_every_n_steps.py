"""checkpoint.every_n_steps in run_local: every step publishes a version of the weights, the full resumable state
(optimizer, RNG, counters) goes into every n-th version and the last; the training is bitwise the every-step
run's, and a run interrupted on a weights-only version refuses to resume from it, naming the field and the
newest version it can resume from."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from unirl_core.checkpoint import CheckpointStore, load_manifest
from unirl_core.checkpoint.store import TRAIN_STATE
from unirl_core.config import load_recipe
from unirl_core.errors import CheckpointError
from unirl_core.loop import phases
from unirl_core.loop.executors import in_process
from unirl_core.loop.local import run_local

KEYS = ("train/loss", "train/grad_norm", "train/ratio_mean", "reward/mean")


def _cfg(root, steps, *extra):
    return load_recipe("tiny-grpo", [f"checkpoint.root={root}", f"loop.total_steps={steps}", "report.progress=false",
                                     "train.lr=5e-2", "checkpoint.keep_last=10", *extra])


def _full_steps(cfg) -> list[int]:
    store = CheckpointStore(cfg.checkpoint.root, cfg.name)
    return [v.step for v in store.versions() if TRAIN_STATE in load_manifest(v).files]


def _weights(cfg, step):
    return safetensors.torch.load_file(f"{cfg.checkpoint.root}/{cfg.name}/step-{step:08d}/model.safetensors")


@pytest.mark.slow
def test_full_state_every_n_steps_trains_the_same_run(tmp_path):
    torch.set_num_threads(1)
    every, sparse = _cfg(tmp_path / "a", 5), _cfg(tmp_path / "b", 5, "checkpoint.every_n_steps=2")
    ha, hb = run_local(every), run_local(sparse)
    for a, b in zip(ha, hb, strict=True):
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS]
    assert _full_steps(every) == [0, 1, 2, 3, 4, 5]
    assert _full_steps(sparse) == [0, 2, 4, 5]  # step 0 (init), every 2nd, and the last
    for step in range(1, 6):  # every step still has its weights
        wa, wb = _weights(every, step), _weights(sparse, step)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sizes = {s: sum(int(f["bytes"]) for f in load_manifest(v).files.values())
             for s, v in ((v.step, v) for v in CheckpointStore(sparse.checkpoint.root, sparse.name).versions())}
    assert sizes[3] < sizes[4] / 2  # a weights-only version is a fraction of a full one (AdamW: 2x the weights)


def test_resume_from_a_weights_only_version_names_the_newest_full_one(tmp_path):
    torch.set_num_threads(1)
    cfg = _cfg(tmp_path, 5, "checkpoint.every_n_steps=2")

    def stop_after_3(metrics, _batch):
        if len(seen) == 2:
            raise KeyboardInterrupt
        seen.append(metrics)

    seen: list[dict] = []
    with pytest.raises(KeyboardInterrupt):
        run_local(cfg, on_step=stop_after_3)
    store = CheckpointStore(cfg.checkpoint.root, cfg.name)
    assert store.latest().step == 3 and _full_steps(cfg) == [0, 2]
    in_process().resident.clear()  # a new process: no trainer holds version 3 (in this one it would go on from it)
    with pytest.raises(CheckpointError, match=r"checkpoint.every_n_steps=2: expected a full resumable state in "
                                              r".*step-00000003.*newest version at or before it that has one: "
                                              r"step 2 .*fork the run from that version"):
        run_local(cfg)
    assert store.latest().step == 3  # nothing was published by the refused resume


@pytest.mark.slow
def test_weights_only_versions_hold_the_compute_dtype(tmp_path):
    """A bf16 model trained with fp32 masters: the versions without the full state hold the weights rounded to
    bf16 (half the bytes; what the rollout bundle rounds them to anyway), the full ones the fp32 masters, and the
    run is bitwise the every-step run (whose rollouts take the same rounding of the same masters)."""
    torch.set_num_threads(1)
    bf16 = ("lm.model.dtype=bfloat16", "train.master_weights=fp32")
    every, sparse = _cfg(tmp_path / "a", 4, *bf16), _cfg(tmp_path / "b", 4, *bf16, "checkpoint.every_n_steps=2")
    ha, hb = run_local(every), run_local(sparse)
    for a, b in zip(ha, hb, strict=True):
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS]
    assert _full_steps(sparse) == [0, 2, 4]
    for step in range(1, 5):
        wa, wb = _weights(every, step), _weights(sparse, step)
        assert wa.keys() == wb.keys() and {t.dtype for t in wa.values()} == {torch.float32}
        want = torch.float32 if step % 2 == 0 else torch.bfloat16
        assert {t.dtype for t in wb.values()} == {want}
        assert all(torch.equal(wa[k].to(want), wb[k]) for k in wa)
