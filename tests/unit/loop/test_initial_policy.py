"""The step-0 policy export a dedicated engine starts from, and when the loop syncs weights to the engine."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from unirl_core.checkpoint import CheckpointRef, load_weights
from unirl_core.config import load_recipe
from unirl_core.errors import CheckpointError
from unirl_core.runtime import build
from unirl_core.loop.phases import init_run


def _cfg(root, *over):
    return load_recipe("tiny-grpo-vllm", [f"checkpoint.root={root}", *over])


def test_which_runs_export():
    assert build.needs_initial_policy(_cfg("runs"))
    assert not build.needs_initial_policy(_cfg("runs", "lm.vllm.model=/models/policy"))
    assert not build.needs_initial_policy(load_recipe("tiny-grpo"))


def test_init_run_exports_the_step0_policy_as_a_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tmp_path)
    with pytest.raises(CheckpointError, match=r"hf-init=.*expected the step-0 policy exported by init_run"):
        build.initial_policy_dir(cfg)
    ref = init_run(cfg)
    folder = build.initial_policy_dir(cfg)
    assert folder == str(tmp_path / cfg.name / build.INITIAL_POLICY_DIR) and ref.step == 0
    marker = json.loads((tmp_path / cfg.name / "hf-init" / "export.json").read_text())
    assert {"config.json", "model.safetensors"} <= set(marker["files"])
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    step0 = load_weights(ref)  # full fine-tune: every weight is in the checkpoint
    assert all(torch.equal(loaded[k], step0[k]) for k in step0)
    # the store ignores the folder: it is no version
    assert [r.step for r in build.store(cfg).versions()] == [0]


def test_export_is_kept_when_complete_and_redone_when_partial(tmp_path):
    cfg = _cfg(tmp_path)
    policy = build.fresh_bundle(cfg)
    uri = build.export_initial_policy(cfg, policy)
    weights = os.path.join(uri, "model.safetensors")
    before = os.stat(weights).st_mtime_ns
    assert build.export_initial_policy(cfg, policy) == uri and os.stat(weights).st_mtime_ns == before
    os.remove(os.path.join(uri, "export.json"))  # an interrupted export: files without the marker
    build.export_initial_policy(cfg, policy)
    assert os.path.exists(os.path.join(uri, "export.json")) and os.stat(weights).st_mtime_ns != before


def test_remote_root_is_downloaded_once_per_process(tmp_path):
    cfg = _cfg("memory://unirl-test-root")
    try:
        build.export_initial_policy(cfg, build.fresh_bundle(cfg))
        local = build.initial_policy_dir(cfg)
        assert not local.startswith("memory") and os.path.isfile(os.path.join(local, "model.safetensors"))
        assert build.initial_policy_dir(cfg) == local
    finally:
        import fsspec

        fsspec.filesystem("memory").rm("/unirl-test-root", recursive=True)


def test_engine_sync_rule(tmp_path):
    ref = CheckpointRef(uri="/r/run/step-00000002", run="run", step=2, policy_version=2)
    slot = build.EngineSlot(key="k", engine=SimpleNamespace(policy_version=build.UNSYNCED_VERSION), staging=tmp_path)
    assert slot.needs_sync(ref)  # a started server serves its start folder: always sync first
    slot.engine.policy_version, slot.served_uri = 2, ref.uri
    assert not slot.needs_sync(ref)
    assert slot.needs_sync(CheckpointRef(uri="/r/run/step-00000003", run="run", step=3, policy_version=3))
    assert slot.needs_sync(CheckpointRef(uri="/other/run/step-00000002", run="run", step=2, policy_version=2))
    slot.asleep_level = 2  # colocate level 2 dropped the weights
    assert slot.needs_sync(ref)
    slot.asleep_level = 1
    assert not slot.needs_sync(ref)


def test_staging_keeps_only_the_served_version(tmp_path):
    for v in (1, 2, 3):
        (tmp_path / f"policy-v{v:08d}").mkdir()
    (tmp_path / "server.log").write_text("not ours to delete")
    slot = build.EngineSlot(key="k", engine=SimpleNamespace(policy_version=2), staging=tmp_path)
    slot.prune_staging()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v00000002", "server.log"]
