"""SFT through the shipped path (records -> supervised Parts -> TrainBackend -> versions) on both tiny presets."""

from __future__ import annotations

import json

import torch

from unirl_core.checkpoint import CheckpointStore, load_weights
from unirl_core.sft import phases
from unirl_core.sft.config import load_sft_recipe
from unirl_core.sft.local import METRICS_FILE, run_sft

torch.set_num_threads(1)


def _fixed_loss(cfg, ref, step: int) -> float:
    """The SFT loss of step ``step``'s records with that step's fixed draws, under the weights of ``ref``."""
    backend = phases.trainer(cfg)
    from unirl_core.checkpoint import restore_train_checkpoint

    restore_train_checkpoint(backend, ref)
    batch = phases.step_batch(cfg, backend.policy, step, policy_version=0)
    with torch.no_grad(), backend.compute():
        return float(backend.algorithm.loss(backend.policy, batch, old_log_probs=None).loss)


def test_diffusion_sft_loss_decreases_and_versions_are_published(tmp_path, image_records):
    cfg = load_sft_recipe("sft-tiny-sd3", [f"checkpoint.root={tmp_path / 'runs'}", f"data.path={image_records}",
                                           "loop.total_steps=12", "loop.steps_per_chunk=6", "train.lr=2e-3"])
    hist = run_sft(cfg, export=False, progress=False)
    assert [h["step"] for h in hist] == [float(s) for s in range(1, 13)]
    store = CheckpointStore(str(tmp_path / "runs"), cfg.name)
    assert [v.step for v in store.versions()] == [0, 6, 12] and store.latest().step == 12
    start, end = store.versions()[0], store.latest()
    before, after = _fixed_loss(cfg, start, 1), _fixed_loss(cfg, end, 1)
    assert after < 0.7 * before, (before, after)
    lines = (tmp_path / "runs" / cfg.name / METRICS_FILE).read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [float(s) for s in range(1, 13)]


def test_lm_sft_loss_decreases(tmp_path, text_records):
    cfg = load_sft_recipe("sft-tiny-lm", [f"checkpoint.root={tmp_path / 'runs'}", f"data.path={text_records}",
                                          "loop.total_steps=10", "loop.steps_per_chunk=10"])
    hist = run_sft(cfg, export=False, progress=False)
    assert len(hist) == 10 and all(h["sft/tokens"] > 0 for h in hist)
    store = CheckpointStore(str(tmp_path / "runs"), cfg.name)
    before, after = _fixed_loss(cfg, store.versions()[0], 1), _fixed_loss(cfg, store.latest(), 1)
    assert after < 0.7 * before, (before, after)


def test_resume_continues_bit_exactly(tmp_path, text_records):
    over = [f"data.path={text_records}", "loop.steps_per_chunk=2"]
    a = load_sft_recipe("sft-tiny-lm", over + [f"checkpoint.root={tmp_path / 'a'}", "loop.total_steps=4"])
    run_sft(a, export=False, progress=False)
    b2 = load_sft_recipe("sft-tiny-lm", over + [f"checkpoint.root={tmp_path / 'b'}", "loop.total_steps=2"])
    run_sft(b2, export=False, progress=False)
    b4 = load_sft_recipe("sft-tiny-lm", over + [f"checkpoint.root={tmp_path / 'b'}", "loop.total_steps=4"])
    rest = run_sft(b4, export=False, progress=False)
    assert [h["step"] for h in rest] == [3.0, 4.0]
    wa = load_weights(CheckpointStore(str(tmp_path / "a"), a.name).latest())
    wb = load_weights(CheckpointStore(str(tmp_path / "b"), a.name).latest())
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lm_sft_export_is_a_transformers_folder_with_its_marker_last(tmp_path, text_records):
    from transformers import AutoModelForCausalLM

    cfg = load_sft_recipe("sft-tiny-lm", [f"checkpoint.root={tmp_path / 'runs'}", f"data.path={text_records}",
                                          "loop.total_steps=1", "loop.steps_per_chunk=1"])
    run_sft(cfg, export=True, progress=False)
    out = tmp_path / "runs" / cfg.name / "export"
    marker = json.loads((out / "export.json").read_text())
    assert marker["format"] == "transformers" and marker["step"] == 1
    latest = CheckpointStore(str(tmp_path / "runs"), cfg.name).latest()
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    want = load_weights(latest)
    assert all(torch.equal(loaded[k], want[k]) for k in want)
