"""``checkpoint.weights_encoding: delta`` in run_local: the same tiny run with full versions and with delta
versions trains bitwise the same, every version reads back to the same bits, and a run interrupted and resumed
(from the newest full state, in a fresh executor) goes on exactly as the uninterrupted full-version run."""

from __future__ import annotations

import pytest
import torch

from unirl_core.checkpoint import CheckpointStore, load_manifest, load_weights
from unirl_core.checkpoint.delta import WeightsMemory, bits
from unirl_core.config import load_recipe
from unirl_core.loop.executors import in_process
from unirl_core.loop.local import run_local

KEYS = ("train/loss", "train/grad_norm", "train/ratio_mean", "reward/mean")
BF16 = ("lm.model.dtype=bfloat16", "train.master_weights=fp32")


def _cfg(root, steps, *extra):
    return load_recipe("tiny-grpo", [f"checkpoint.root={root}", f"loop.total_steps={steps}", "report.progress=false",
                                     "train.lr=1e-3", "checkpoint.keep_last=20", "checkpoint.every_n_steps=3",
                                     *BF16, *extra])


def _versions(cfg) -> dict[int, dict[str, torch.Tensor]]:
    store = CheckpointStore(cfg.checkpoint.root, cfg.name)
    return {r.step: load_weights(r, storage_options=cfg.checkpoint.storage_options) for r in store.versions()}


def _chains(cfg) -> dict[int, list[int]]:
    return {r.step: load_manifest(r).chain for r in CheckpointStore(cfg.checkpoint.root, cfg.name).versions()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def _fresh_process() -> None:
    """What a new process would not have: the trainer's resident state and the writer's last version."""
    ex = in_process()
    ex.finish_writes()
    ex.resident.clear()
    ex.writer.memory = WeightsMemory()


@pytest.mark.slow
def test_delta_versions_train_and_resume_bitwise_as_full_versions(tmp_path):
    torch.set_num_threads(1)
    _fresh_process()
    full = _cfg(tmp_path / "full", 7)
    delta = _cfg(tmp_path / "delta", 7, "checkpoint.weights_encoding=delta", "checkpoint.anchor_every=8")
    hf = run_local(full)
    _fresh_process()
    hd = run_local(delta)
    for a, b in zip(hf, hd, strict=True):  # rollouts (rewards) and updates: bitwise the same
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS]
    chains = _chains(delta)
    # full states at 0 (init_run's, not through the loop's writer: 1 is an anchor), 3, 6 and the last
    assert chains == {0: [], 1: [], 2: [1], 3: [], 4: [3], 5: [3, 4], 6: [], 7: []}
    assert all(not c for c in _chains(full).values())
    vf, vd = _versions(full), _versions(delta)
    assert vf.keys() == vd.keys() == set(range(8))
    for step in vf:
        assert _same(vf[step], vd[step]), step
    store = CheckpointStore(delta.checkpoint.root, delta.name)
    sizes = {r.step: sum(int(f["bytes"]) for f in load_manifest(r).files.values()) for r in store.versions()}
    fsizes = {r.step: sum(int(f["bytes"]) for f in load_manifest(r).files.values())
              for r in CheckpointStore(full.checkpoint.root, full.name).versions()}
    assert all(sizes[s] < fsizes[s] for s in (2, 4, 5)), (sizes, fsizes)

    # the delta run again, interrupted after step 3 (a full state after deltas 1, 2) and resumed by a fresh
    # executor: the rest of the run is the full-version run's, bit for bit
    again = _cfg(tmp_path / "again", 7, "checkpoint.weights_encoding=delta", "checkpoint.anchor_every=8")
    seen: list[dict] = []

    def stop_after_3(metrics, _batch):
        if len(seen) == 2:
            raise KeyboardInterrupt
        seen.append(metrics)

    _fresh_process()
    with pytest.raises(KeyboardInterrupt):
        run_local(again, on_step=stop_after_3)
    assert CheckpointStore(again.checkpoint.root, again.name).latest().step == 3
    _fresh_process()
    resumed = run_local(again)
    assert [[m[k] for k in KEYS] for m in resumed] == [[m[k] for k in KEYS] for m in hf[3:]]
    va = _versions(again)
    assert va.keys() == vf.keys() and all(_same(vf[s], va[s]) for s in vf)
    assert _chains(again) == {0: [], 1: [], 2: [1], 3: [], 4: [], 5: [4], 6: [], 7: []}  # a fresh writer: 4 anchors


@pytest.mark.slow
def test_lagged_rollouts_fed_deltas_sample_bitwise_as_fed_full_versions(tmp_path):
    """Lag 1: each rollout loads version ``step - 2`` into the process's rollout bundle from the store. With delta
    versions a bundle holding the delta's base gets the delta alone (checked against the version's digest); the
    rollouts, and so the whole run, are bitwise the full-version run's."""
    torch.set_num_threads(1)
    lag = ("async_training.max_policy_lag=1",)
    full = _cfg(tmp_path / "full", 7, *lag)
    delta = _cfg(tmp_path / "delta", 7, *lag, "checkpoint.weights_encoding=delta", "checkpoint.anchor_every=8")
    _fresh_process()
    hf = run_local(full)
    _fresh_process()
    hd = run_local(delta)
    for a, b in zip(hf, hd, strict=True):
        assert [a[k] for k in KEYS] == [b[k] for k in KEYS]
    fed = [m.get("rollout/weights_delta", 0.0) for m in hd]
    assert not any("rollout/weights_delta" in m for m in hf)
    # step n samples version n - 2: versions 2, 4, 5 are deltas of 1, 3, 4, which the bundle then holds (0, 1 and
    # 3 are full versions: read in full)
    assert fed == [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
