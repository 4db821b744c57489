"""Replay of composed runs: three steps of a run training both stacks (with the enhancer's KL reference) are bitwise
equal to what the run stored - the batch (rewrites and images, rewards, advantages) and both stacks' versions; a
changed stored rewrite or reward fails naming the field; a frozen image stack replays from its step-0 version."""

from __future__ import annotations

import pytest

from tests.unit.compose.conftest import small_config
from unirl_core.checkpoint.batches import BatchStore
from unirl_core.runs.__main__ import main
from unirl_core.compose.local import run_compose_local
from unirl_core.runs.replay_compose import replay_compose
from unirl_core.errors import ConfigError
from unirl_core.runs.replay import ReplayInputMissing, ReplayMismatch, replay

KEEP = ["checkpoint.keep_batches=true", "checkpoint.keep_every=1", "loop.total_steps=3"]


@pytest.mark.slow
def test_joint_run_replays_three_steps_and_names_a_changed_field(tmp_path):
    cfg = small_config(tmp_path, *KEEP, "enhancer.lm.model.keep_reference=true", "enhancer.lm.algorithm.beta=0.05")
    run_compose_local(cfg, resume_from="never", progress=False)
    run = f"{tmp_path}/{cfg.name}"
    assert (tmp_path / cfg.name / "enhancer-reference").is_dir()
    for step in (1, 2, 3):
        report = replay_compose(run, step=step)
        assert report.samples == 8 and "/enhancer/" in report.version and "/image/" in report.version
    assert not (tmp_path / cfg.name / "replay").exists()
    store = BatchStore(str(tmp_path), cfg.name)
    original = store.load(2)
    batch = store.load(2)
    batch.samples[1].parts[0].text = (batch.samples[1].parts[0].text or "") + " circle"
    store.save(2, batch, config=store.config(2))
    with pytest.raises(ReplayMismatch, match="field 'text'"):
        replay_compose(run, step=2)
    batch = store.load(2)
    batch.samples[1].parts[0].text = original.samples[1].parts[0].text
    batch.samples[0].parts[-1].reward += 0.25
    store.save(2, batch, config=store.config(2))
    assert main(["replay", run, "--step", "2"]) == 1  # the CLI: the mismatch, exit status 1
    store.save(2, original, config=store.config(2))
    assert main(["replay", run, "--step", "2"]) == 0
    with pytest.raises(ConfigError, match="python -m unirl_core.runs replay"):
        replay(run, step=2)  # the RL replay points a composed run to its own


@pytest.mark.slow
def test_frozen_image_stack_and_missing_inputs(tmp_path):
    cfg = small_config(tmp_path, *KEEP, "image.frozen=true")
    run_compose_local(cfg, resume_from="never", progress=False)
    run = f"{tmp_path}/{cfg.name}"
    assert "/image/" not in replay_compose(run, step=3).version
    bare = small_config(tmp_path, "image.frozen=true", "loop.total_steps=1", name="bare")
    run_compose_local(bare, resume_from="never", progress=False)
    with pytest.raises(ReplayInputMissing, match="checkpoint.keep_batches=true"):
        replay_compose(f"{tmp_path}/bare", step=1)
