"""The vLLM worker extension's delta path (``unirl_apply_delta``) on a stand-in worker: what it loads into the model,
and that every refusal leaves the served model untouched. The real server: tests/integration/test_vllm_delta.py."""

from __future__ import annotations

import safetensors.torch
import torch

from unirl_core.checkpoint.delta import DeltaVersions, WeightsMemory
from unirl_core.checkpoint.store import WEIGHTS, CheckpointStore, load_manifest, read_delta
from unirl_core.rollout.vllm.worker_ext import WeightSyncExtension


class _Runner:
    def get_model(self):
        return torch.nn.Linear(2, 2)  # no config: no tied head to refresh


class _Worker(WeightSyncExtension):
    """vLLM's worker as the extension sees it: ``reload_weights`` from a folder or an iterator, recorded."""

    def __init__(self) -> None:
        self.model_runner = _Runner()
        self.loads: list[object] = []

    def reload_weights(self, weights_path: str | None = None, weights_iterator=None) -> None:
        if weights_iterator is not None:
            self.loads.append({k: v.clone() for k, v in weights_iterator})
        else:
            self.loads.append(weights_path)


def _versions(tmp_path):
    torch.manual_seed(0)
    w1 = {"a.weight": torch.randn(8, 4), "b.weight": torch.randn(16).to(torch.bfloat16)}
    w2 = {k: (v.float() + 1e-3 * torch.randn(v.shape)).to(v.dtype) for k, v in w1.items()}
    store = CheckpointStore(str(tmp_path / "ckpt"), "r", keep_last=10, encoding=DeltaVersions(8))
    memory = WeightsMemory()
    r1 = store.save(1, weights=w1, policy_version=1, memory=memory)
    r2 = store.save(2, weights=w2, policy_version=2, memory=memory)
    m2, blob = read_delta(r2)
    assert m2.delta is not None
    delta_path = tmp_path / "v2.xor.zst"
    delta_path.write_bytes(blob)
    folder = tmp_path / "v1"
    folder.mkdir()
    safetensors.torch.save_file(w1, str(folder / "model.safetensors"))
    args = {"delta_path": str(delta_path), "size": int(m2.delta["bytes"]), "base_sha256": m2.delta["base_sha256"],
            "sha256": m2.delta["sha256"]}
    return w2, folder, load_manifest(r1).weights_sha256(WEIGHTS), args


def test_delta_on_the_kept_base_loads_the_version_bitwise(tmp_path):
    w2, folder, sha1, args = _versions(tmp_path)
    worker = _Worker()
    assert worker.unirl_reload_weights(str(folder), keep_sha256=sha1)["kept"]
    out = worker.unirl_apply_delta(**args)
    assert out["applied"] and out["bytes_read"] == (tmp_path / "v2.xor.zst").stat().st_size
    loaded = worker.loads[-1]
    assert set(loaded) == set(w2)
    for k, v in w2.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)), k
    assert worker._unirl_held[0] == args["sha256"]  # the next delta's base


def test_refusals_leave_the_model_untouched(tmp_path):
    _, folder, sha1, args = _versions(tmp_path)
    worker = _Worker()
    assert worker.unirl_apply_delta(**args) == {"applied": False, "reason": "no kept base"}
    worker.unirl_reload_weights(str(folder))  # no digest: nothing kept
    assert worker.unirl_apply_delta(**args)["reason"] == "no kept base"
    worker.unirl_reload_weights(str(folder), keep_sha256="0" * 64)  # kept under another version's digest
    assert worker.unirl_apply_delta(**args)["reason"] == "not at the delta's base"
    worker.unirl_reload_weights(str(folder), keep_sha256=sha1)
    out = worker.unirl_apply_delta(**{**args, "size": args["size"] + 1})  # does not decode to the manifest's size
    assert not out["applied"] and "decompressed to" in out["reason"]
    assert worker._unirl_held is not None  # nothing was XOR-ed: the copy is still the base
    assert worker.loads == [str(folder), str(folder), str(folder)]
    # The right digest claimed for other weights: the result's digest does not match, nothing is loaded and the
    # copy (XOR-ed into) is dropped.
    other = tmp_path / "other"
    other.mkdir()
    w1 = safetensors.torch.load_file(str(folder / "model.safetensors"))
    w1["a.weight"][0, 0] += 1.0
    safetensors.torch.save_file(w1, str(other / "model.safetensors"))
    worker.unirl_reload_weights(str(other), keep_sha256=sha1)
    out = worker.unirl_apply_delta(**args)
    assert not out["applied"] and out["reason"].startswith("digest ")
    assert worker.loads == [str(folder), str(folder), str(folder), str(other)] and worker._unirl_held is None
