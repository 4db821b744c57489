"""Delta versions (``checkpoint.delta``): lossless XOR deltas against the previous version, chains read from the
manifests alone, anchors, retention that keeps every link a kept version needs, damaged links named."""

import json
import shutil

import pytest
import torch

from unirl_core.checkpoint import CheckpointStore, load_manifest, load_weights
from unirl_core.checkpoint.delta import DELTA_FILE, DeltaVersions, WeightsMemory, bits, weights_digest
from unirl_core.checkpoint.store import WEIGHTS, read_delta
from unirl_core.checkpoint.writer import VersionWriter
from unirl_core.config.run import CheckpointConfig
from unirl_core.errors import CheckpointError, ConfigError


def trained(steps: int, *, seed: int = 0, lr: float = 1e-3) -> list[dict[str, torch.Tensor]]:
    """fp32 masters moved by a small update each step, as a trainer's would be."""
    g = torch.Generator().manual_seed(seed)
    w = {"layer.weight": torch.randn(256, 128, generator=g) * 0.05, "layer.bias": torch.zeros(128),
         "emb": torch.randn(64, 32, generator=g), "mask": torch.rand(7, generator=g) > 0.5}
    out = []
    for _ in range(steps):
        w = {k: v if v.dtype == torch.bool else v - lr * torch.randn(v.shape, generator=g).sign() for k, v in w.items()}
        out.append({k: v.clone() for k, v in w.items()})
    return out


def bf16(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def write_run(store: CheckpointStore, steps: int, *, every_full: int = 4, memory: WeightsMemory | None = None,
              **kw) -> dict[int, dict[str, torch.Tensor]]:
    """Versions 1..steps: a full state (fp32 weights + train_state) every ``every_full``-th, bf16 weights-only
    versions between, as ``every_n_steps`` writes them."""
    memory = memory or WeightsMemory()
    written = {}
    for step, w in enumerate(trained(steps, **kw), start=1):
        full = step % every_full == 0
        weights = w if full else bf16(w)
        store.save(step, weights=weights, policy_version=step, memory=memory,
                   train_state={"step": torch.tensor(step)} if full else None)
        written[step] = weights
    return written


def test_delta_versions_read_back_bit_exact_with_anchors_and_full_states(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=100, encoding=DeltaVersions(anchor_every=3))
    written = write_run(store, 9)
    chains = {}
    for ref in store.versions():
        m = load_manifest(ref)
        chains[ref.step] = m.chain
        got = load_weights(ref)
        assert same_bits(got, written[ref.step]), ref.step
        assert m.weights_sha256(WEIGHTS) == weights_digest(written[ref.step])
        assert (DELTA_FILE in m.files) == bool(m.chain) and (WEIGHTS in m.files) != bool(m.chain)
    # a full version at every full state (4, 8) and at least every 3 versions; the fp32 full state is the base of
    # the next bf16 delta (the XOR is against its values rounded to bf16)
    assert chains == {1: [], 2: [1], 3: [1, 2], 4: [], 5: [4], 6: [4, 5], 7: [], 8: [], 9: [8]}
    delta = load_manifest(store.versions()[1])
    assert delta.schema_version == 2 and delta.delta["base"] == 1
    assert delta.files[DELTA_FILE]["bytes"] < 0.5 * delta.delta["bytes"]  # the XOR compresses


def test_full_encoding_and_no_memory_write_full_versions(tmp_path):
    full = CheckpointStore(str(tmp_path), "full")
    write_run(full, 3)
    assert all(not load_manifest(r).chain and load_manifest(r).schema_version == 1 for r in full.versions())
    store = CheckpointStore(str(tmp_path), "nomem", encoding=DeltaVersions(8))
    for step, w in enumerate(trained(3), start=1):
        store.save(step, weights=bf16(w), policy_version=step)  # no writer memory: nothing to encode against
    assert all(DELTA_FILE not in load_manifest(r).files for r in store.versions())


def test_a_base_that_is_not_in_the_store_as_written_gives_a_full_version(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", encoding=DeltaVersions(8))
    memory = WeightsMemory()
    ws = [bf16(w) for w in trained(4)]
    store.save(1, weights=ws[0], policy_version=1, memory=memory)
    store.save(1, weights=ws[1], policy_version=1, overwrite=True)  # someone rewrote the base since
    store.save(2, weights=ws[2], policy_version=2, memory=memory)
    assert load_manifest(store.versions()[1]).chain == []
    other = CheckpointStore(str(tmp_path), "other", encoding=DeltaVersions(8))
    other.save(3, weights=ws[3], policy_version=3, memory=memory)  # memory of another run
    assert load_manifest(other.versions()[0]).chain == []
    changed = {**ws[3], "emb": torch.zeros(2, 2, dtype=torch.bfloat16)}
    store.save(3, weights=changed, policy_version=3, memory=WeightsMemory())
    store.save(4, weights=ws[3], policy_version=4, memory=memory)  # memory holds version 3 of 'other'
    assert load_manifest(store.versions()[-1]).chain == []


def test_retention_keeps_every_link_a_kept_version_needs(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=2, encoding=DeltaVersions(anchor_every=5))
    written = write_run(store, 8, every_full=100)
    # 1 is an anchor with deltas 2..5, 6 the next anchor (a chain holds at most 5 versions) with deltas 7, 8:
    # keep_last=2 keeps 7, 8 and their link 6
    assert [r.step for r in store.versions()] == [6, 7, 8]
    assert [load_manifest(r).chain for r in store.versions()] == [[], [6], [6, 7]]
    for ref in store.versions():
        assert same_bits(load_weights(ref), written[ref.step])
    store.save(9, weights=trained(9)[-1], policy_version=9, train_state={"s": torch.ones(1)})
    assert [r.step for r in store.versions()] == [6, 7, 8, 9]  # 8 is kept, so is its whole chain


def test_a_damaged_delta_fails_naming_the_file(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=100, encoding=DeltaVersions(8))
    write_run(store, 4, every_full=100)
    ref = store.versions()[-1]
    path = tmp_path / "r" / "step-00000003" / DELTA_FILE  # a link in the middle of version 4's chain
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"step-00000003/model\.xor\.zst.*corrupted"):
        load_weights(ref)
    with pytest.raises(CheckpointError, match=r"step-00000003/model\.xor\.zst"):
        store.load(ref)
    anchor = tmp_path / "r" / "step-00000001" / WEIGHTS
    anchor.write_bytes(anchor.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"step-00000001/model\.safetensors.*truncated"):
        load_weights(store.versions()[1])


def test_a_missing_or_rewritten_link_fails_naming_it(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=100, encoding=DeltaVersions(8))
    write_run(store, 4, every_full=100)  # 1 full, 2..4 deltas
    last = store.versions()[-1]
    store.save(2, weights=bf16(trained(2, seed=5)[-1]), policy_version=2, overwrite=True)  # now a full version
    with pytest.raises(CheckpointError, match=r"step-00000002/manifest\.json='a full version'.*a delta against"):
        load_weights(last)
    other = bf16(trained(2, seed=6)[-1])
    store.save(2, weights=other, policy_version=2, overwrite=True, memory=_memory_of(store, 1))  # a delta of 1 again
    assert load_manifest(store.versions()[1]).chain == [1] and same_bits(load_weights(store.versions()[1]), other)
    with pytest.raises(CheckpointError, match=r"step-00000003/manifest\.json='base sha256 [0-9a-f]+'"):
        load_weights(last)  # 3 was a delta of the old 2
    shutil.rmtree(tmp_path / "r" / "step-00000001")
    with pytest.raises(CheckpointError, match=r"step-00000001/manifest\.json.*missing"):
        load_weights(store.versions()[0])


def _memory_of(store: CheckpointStore, step: int) -> WeightsMemory:
    """A writer memory holding version ``step`` of ``store``."""
    ref = next(r for r in store.versions() if r.step == step)
    memory = WeightsMemory(tensors={k: v.clone() for k, v in load_weights(ref).items()})
    memory.version = (store.uri, step, load_manifest(ref).weights_sha256(WEIGHTS), tuple(load_manifest(ref).chain))
    return memory


def test_a_delta_whose_zstd_stream_is_bad_fails_naming_it(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", encoding=DeltaVersions(8))
    write_run(store, 2, every_full=100)
    folder = tmp_path / "r" / "step-00000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["delta"]["bytes"] += 8  # the checksum holds; the stream decodes to another size
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"step-00000002/model\.xor\.zst.*decompressed to"):
        load_weights(store.versions()[-1])


def test_read_delta_gives_the_file_an_engine_applies(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", encoding=DeltaVersions(8))
    write_run(store, 2, every_full=100)
    full, blob = read_delta(store.versions()[0])
    assert blob is None and full.delta is None
    m, blob = read_delta(store.versions()[1])
    assert m.delta["base_sha256"] == full.weights_sha256(WEIGHTS) and len(blob) == m.files[DELTA_FILE]["bytes"]


def test_a_background_writer_writes_deltas_against_its_previous_version(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=100, encoding=DeltaVersions(8))
    writer = VersionWriter()
    ws = [bf16(w) for w in trained(3)]
    for step, w in enumerate(ws, start=1):
        writer.publish(writer.save(store, step, policy_version=step, live=[], weights=w))
    writer.wait()
    assert [load_manifest(r).chain for r in store.versions()] == [[], [1], [1, 2]]
    assert all(same_bits(load_weights(r), ws[r.step - 1]) for r in store.versions())
    assert store.latest().step == 3


def test_anchor_every_is_checked():
    with pytest.raises(ConfigError, match=r"checkpoint\.anchor_every.*0"):
        CheckpointConfig(weights_encoding="delta", anchor_every=0)
    with pytest.raises(ConfigError, match=r"checkpoint\.anchor_every"):
        DeltaVersions(anchor_every=0)
    with pytest.raises(ConfigError, match=r"checkpoint\.weights_encoding='delta'.*every_n_steps > 1"):
        CheckpointConfig(weights_encoding="delta")  # every version holds the full state: no delta is ever written
    assert CheckpointConfig(weights_encoding="delta", every_n_steps=4).anchor_every == 8
    assert CheckpointConfig(weights_encoding="delta", full_state="sharded").weights_encoding == "delta"


def test_a_full_version_with_other_names_resets_the_memory(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=100, encoding=DeltaVersions(8))
    memory = WeightsMemory()
    ws = [bf16(w) for w in trained(4)]
    store.save(1, weights=ws[0], policy_version=1, memory=memory)
    fewer = [{k: v for k, v in w.items() if k != "emb"} for w in ws]
    store.save(2, weights=fewer[1], policy_version=2, memory=memory)  # other names: a full version
    store.save(3, weights=fewer[2], policy_version=3, memory=memory)  # a delta of 2 (the memory forgot 'emb')
    assert [load_manifest(r).chain for r in store.versions()] == [[], [], [2]]
    assert same_bits(load_weights(store.versions()[-1]), fewer[2]) and set(memory.tensors) == set(fewer[2])


def test_a_damaged_delta_record_makes_the_version_invisible_and_names_the_manifest(tmp_path):
    store = CheckpointStore(str(tmp_path), "r", keep_last=100, encoding=DeltaVersions(8))
    write_run(store, 2, every_full=100)
    ref = store.versions()[-1]
    path = tmp_path / "r" / "step-00000002" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["delta"]["chain"] = "1"
    path.write_text(json.dumps(manifest))
    assert [r.step for r in store.versions()] == [1] and store.latest().step == 1
    with pytest.raises(CheckpointError, match=r"step-00000002/manifest\.json: delta"):
        load_weights(ref)
    manifest["schema_version"] = 3
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"schema_version=3: expected one of \(1, 2\)"):
        load_weights(ref)
