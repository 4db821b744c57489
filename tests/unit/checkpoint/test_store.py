import io
import json
import os
import pickle

import pytest
import torch

from unirl_core.checkpoint import CheckpointRef, CheckpointStore, load_checkpoint, load_weights
from unirl_core.checkpoint.store import EXTRA, TRAIN_STATE, WEIGHTS
from unirl_core.errors import CheckpointError, ConfigError


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.lora_A.weight": torch.randn(4, 8, generator=g),
        "a.lora_B.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "b.half": torch.randn(3, generator=g).to(torch.float16),
        "c.ids": torch.arange(5, dtype=torch.int64),
    }


def save(store, step, **kw):
    kw.setdefault("weights", tensors(step))
    kw.setdefault("policy_version", step)
    return store.save(step, **kw)


def test_roundtrip_is_bit_exact_with_config_extra_and_state(tmp_path):
    store = CheckpointStore(str(tmp_path), "run0")
    state = {"optimizer": {"state": {"w": {"exp_avg": torch.randn(3)}}, "param_groups": [{"lr": 0.1}]},
             "counters": {"step": 3}}
    ref = save(store, 3, ema_weights=tensors(9), train_state=state, config={"lr": 0.1, "name": "x"},
               extra={"tracker": {"p0": [1.0, 2.0]}})
    assert ref == CheckpointRef(uri=str(tmp_path / "run0" / "step-00000003"), run="run0", step=3, policy_version=3)
    got = store.load()
    for name, t in tensors(3).items():
        assert got.weights[name].dtype == t.dtype and torch.equal(got.weights[name], t)
    assert all(torch.equal(got.ema_weights[k], v) for k, v in tensors(9).items())
    assert torch.equal(got.train_state["optimizer"]["state"]["w"]["exp_avg"], state["optimizer"]["state"]["w"]["exp_avg"])
    assert got.config == {"lr": 0.1, "name": "x"} and got.extra == {"tracker": {"p0": [1.0, 2.0]}}
    man = json.loads((tmp_path / "run0" / "step-00000003" / "manifest.json").read_text())
    assert man["schema_version"] == 1 and man["step"] == 3 and man["policy_version"] == 3 and man["created"] > 0
    assert set(man["files"]) == {"model.safetensors", "ema.safetensors", "train_state.pt", "config.json", "extra.json"}
    assert all(torch.equal(v, tensors(3)[k]) for k, v in load_weights(ref).items())


def test_latest_pointer_and_versions(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=10)
    assert store.latest() is None
    save(store, 1)
    r2 = save(store, 2, publish=False)
    assert store.latest().step == 1  # saved but not published
    store.publish(r2)
    assert store.latest() == r2
    assert [r.step for r in store.versions()] == [1, 2]
    assert json.loads((tmp_path / "r" / "LATEST").read_text())["step"] == 2


def test_folders_without_valid_manifest_do_not_exist(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=10)
    save(store, 1)
    partial = tmp_path / "r" / "step-00000002"
    partial.mkdir()
    (partial / WEIGHTS).write_bytes(b"half a file")
    damaged = tmp_path / "r" / "step-00000003"
    damaged.mkdir()
    (damaged / "manifest.json").write_text('{"schema_version": 1, "files": ')
    (tmp_path / "r" / "notes").mkdir()
    assert [r.step for r in store.versions()] == [1]
    assert store.latest().step == 1


def test_pointer_to_a_vanished_version_falls_back_to_newest_complete(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=10)
    save(store, 1)
    save(store, 2)
    os.remove(tmp_path / "r" / "step-00000002" / "manifest.json")
    assert store.latest().step == 1


@pytest.mark.parametrize("name", [WEIGHTS, TRAIN_STATE, EXTRA])
def test_flipped_byte_is_caught_and_names_the_file(tmp_path, name):
    store = CheckpointStore(str(tmp_path), "r")
    ref = save(store, 1, train_state={"x": torch.ones(3)}, extra={"k": 1})
    path = tmp_path / "r" / "step-00000001" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ref)
    assert f"step-00000001/{name}" in str(e.value) and "sha256" in str(e.value)


def test_truncated_or_missing_file_is_caught(tmp_path):
    store = CheckpointStore(str(tmp_path), "r")
    ref = save(store, 1, train_state={"x": torch.ones(3)})
    path = tmp_path / "r" / "step-00000001" / TRAIN_STATE
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match="train_state.pt.*bytes"):
        load_checkpoint(ref)
    path.unlink()
    with pytest.raises(CheckpointError, match="train_state.pt.*missing"):
        load_checkpoint(ref)


def test_pickled_code_in_train_state_is_refused_even_with_a_matching_checksum(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    store = CheckpointStore(str(tmp_path), "r")
    ref = save(store, 1, train_state={"x": 1})
    folder = tmp_path / "r" / "step-00000001"
    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    (folder / TRAIN_STATE).write_bytes(buf.getvalue())
    man = json.loads((folder / "manifest.json").read_text())
    import hashlib
    man["files"][TRAIN_STATE] = {"sha256": hashlib.sha256(buf.getvalue()).hexdigest(), "bytes": len(buf.getvalue())}
    (folder / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(ref)


def test_retention_keeps_last_k_every_m_and_the_published_one(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=2, keep_every=4)
    for step in range(1, 10):
        save(store, step)
    assert [r.step for r in store.versions()] == [4, 8, 9]
    assert sorted(os.listdir(tmp_path / "r")) == ["LATEST", "step-00000004", "step-00000008", "step-00000009"]
    store2 = CheckpointStore(str(tmp_path), "r", keep_last=1)
    r4 = store2.versions()[0]
    store2.publish(r4)  # an older version published again (a rollback) survives retention
    assert [r.step for r in store2.versions()] == [4, 9]


def test_versions_are_immutable_unless_overwritten(tmp_path):
    store = CheckpointStore(str(tmp_path), "r")
    save(store, 1)
    with pytest.raises(CheckpointError, match="immutable"):
        save(store, 1)
    save(store, 1, weights=tensors(5), overwrite=True)
    assert torch.equal(store.load().weights["a.lora_A.weight"], tensors(5)["a.lora_A.weight"])


def test_partial_folder_of_the_same_step_is_replaced_on_save(tmp_path):
    store = CheckpointStore(str(tmp_path), "r")
    partial = tmp_path / "r" / "step-00000001"
    partial.mkdir(parents=True)
    (partial / "junk.bin").write_bytes(b"x")
    save(store, 1)
    assert sorted(os.listdir(partial)) == ["manifest.json", "model.safetensors"]


@pytest.mark.parametrize("kw", [{"run": "a/b"}, {"run": ""}, {"keep_last": 0}, {"keep_every": 0}])
def test_store_config_is_validated(tmp_path, kw):
    args = {"run": "r"} | kw
    with pytest.raises(ConfigError):
        CheckpointStore(str(tmp_path), **args)


def test_non_json_config_is_rejected_before_anything_is_written(tmp_path):
    store = CheckpointStore(str(tmp_path), "r")
    with pytest.raises(ConfigError, match="config"):
        save(store, 1, config={"bad": object()})
    assert store.versions() == []


def test_tied_weights_are_saved(tmp_path):
    w = torch.randn(4, 4)
    store = CheckpointStore(str(tmp_path), "r")
    save(store, 1, weights={"embed": w, "head": w})
    got = store.load().weights
    assert torch.equal(got["embed"], w) and torch.equal(got["head"], w)


def test_failed_overwrite_keeps_the_old_version(tmp_path):
    store = CheckpointStore(str(tmp_path), "r")
    save(store, 1)
    with pytest.raises(ConfigError):
        save(store, 1, config={"bad": object()}, overwrite=True)
    assert torch.equal(store.load().weights["a.lora_A.weight"], tensors(1)["a.lora_A.weight"])


def test_ema_weights_alone_and_missing_ema_is_named(tmp_path):
    store = CheckpointStore(str(tmp_path), "r")
    ref = save(store, 1, ema_weights=tensors(7))
    assert torch.equal(load_weights(ref, ema=True)["c.ids"], tensors(7)["c.ids"])
    ref2 = save(store, 2)
    with pytest.raises(CheckpointError, match="ema.safetensors"):
        load_weights(ref2, ema=True)


def test_reference_version_reads_the_owners_files_and_pins_them(tmp_path):
    parent = CheckpointStore(str(tmp_path), "p", keep_last=1)
    src = save(parent, 2, ema_weights=tensors(9), train_state={"counters": {"step": 2}}, config={"c": 1},
               extra={"x": 1})
    fork = CheckpointStore(str(tmp_path), "f", keep_last=1)
    ref = fork.save_reference(src, config={"c": 2}, extra={"x": 1, "lineage": {"parent_run": "p"}})
    assert fork.latest() == ref and (ref.step, ref.policy_version) == (2, 2)
    got, orig = fork.load(), parent.load()
    assert got.config == {"c": 2} and got.extra["lineage"] == {"parent_run": "p"}
    assert all(torch.equal(got.weights[k], v) for k, v in orig.weights.items())
    assert all(torch.equal(got.ema_weights[k], v) for k, v in orig.ema_weights.items())
    assert got.train_state == orig.train_state and got.manifest.meta["forked_from"] == "p@2"
    assert sorted(p.name for p in (tmp_path / "f" / "step-00000002").iterdir()) == [
        "config.json", "extra.json", "manifest.json"]
    # a fork of the fork's start version points at the bytes' owner, and pins it and its named parent
    ff = CheckpointStore(str(tmp_path), "ff").save_reference(ref, config={"c": 3}, extra={})
    files = json.loads((tmp_path / "ff" / "step-00000002" / "manifest.json").read_text())["files"]
    assert {files[n]["run"] for n in (WEIGHTS, TRAIN_STATE, "ema.safetensors")} == {"p"} and "run" not in files[EXTRA]
    assert parent.pinned_steps() == {2: ["f", "ff"]} and fork.pinned_steps() == {2: ["ff"]}
    # retention: the parent keeps the pinned version past keep_last=1
    save(parent, 3)
    assert [r.step for r in parent.versions()] == [2, 3]
    # a referenced file deleted by hand: the read names it and its owner
    os.remove(tmp_path / "p" / "step-00000002" / WEIGHTS)
    with pytest.raises(CheckpointError, match=r"p/step-00000002/model.safetensors='missing'.*run 'p' that fork 'ff'"):
        load_weights(ff)
