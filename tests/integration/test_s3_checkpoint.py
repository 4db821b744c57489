"""The checkpoint store against a real S3 server (Ceph RGW on 127.0.0.1), not a mock."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import s3fs
import torch

from tests.unit.train.toy import ToyGRPO, ToyPolicy, rollout
from unirl_core.checkpoint import CheckpointStore, load_checkpoint, load_weights, restore_train_checkpoint, \
    save_train_checkpoint
from unirl_core.errors import CheckpointError
from unirl_core.train import TrainBackend, TrainConfig

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def weights(v: float) -> dict[str, torch.Tensor]:
    return {"lora_A": torch.full((64, 8), v), "lora_B": torch.full((8, 64), v).to(torch.bfloat16)}


def test_server_answers_and_start_time_is_recorded(s3_endpoint):
    fs = s3fs.S3FileSystem(**s3_endpoint.storage_options)
    fs.ls("")  # lists buckets: credentials work
    print(f"S3 endpoint {s3_endpoint.endpoint}, start {s3_endpoint.start_seconds:.1f} s")


def test_roundtrip_pointer_and_retention_on_s3(s3_endpoint, s3_bucket):
    store = CheckpointStore(f"{s3_bucket}/ckpts", "run", keep_last=2, keep_every=3,
                            storage_options=s3_endpoint.storage_options)
    assert store.latest() is None
    refs = [store.save(s, weights=weights(float(s)), policy_version=s, config={"s": s}, extra={"t": [s]})
            for s in range(1, 6)]
    assert refs[-1].uri == f"{s3_bucket}/ckpts/run/step-00000005"
    assert [r.step for r in store.versions()] == [3, 4, 5]
    assert store.latest() == refs[-1]
    got = store.load()
    assert all(torch.equal(got.weights[k], v) for k, v in weights(5.0).items())
    assert got.config == {"s": 5} and got.extra == {"t": [5]}
    only = load_weights(refs[-1], storage_options=s3_endpoint.storage_options)
    assert torch.equal(only["lora_B"], weights(5.0)["lora_B"])


def test_partial_version_is_invisible_and_flipped_byte_is_named(s3_endpoint, s3_bucket):
    opts = s3_endpoint.storage_options
    store = CheckpointStore(s3_bucket, "run", storage_options=opts)
    ref = store.save(1, weights=weights(1.0), policy_version=1, train_state={"x": torch.ones(3)})
    fs = s3fs.S3FileSystem(**opts)
    fs.pipe(f"{s3_bucket}/run/step-00000002/model.safetensors", b"partial upload")
    assert [r.step for r in store.versions()] == [1] and store.latest().step == 1
    key = f"{s3_bucket}/run/step-00000001/train_state.pt"
    data = bytearray(fs.cat(key))
    data[5] ^= 0xFF
    fs.pipe(key, bytes(data))
    with pytest.raises(CheckpointError, match="step-00000001/train_state.pt.*sha256"):
        load_checkpoint(ref, storage_options=opts)


CHILD = textwrap.dedent("""
    import sys, time, torch
    from unirl_core.checkpoint import fsio, store as S
    root = sys.argv[1]
    st = S.CheckpointStore(root, "run")  # endpoint and keys from AWS_* env vars
    st.save(1, weights={"w": torch.ones(1 << 16)}, policy_version=1)
    write = fsio.Folder.write_pieces

    def hook(self, name, pieces, atomic=False, sync=True):
        if name == "train_state.pt":
            print("KILLME", flush=True)
            time.sleep(120)
        return write(self, name, pieces, atomic=atomic, sync=sync)

    fsio.Folder.write_pieces = hook
    st.save(2, weights={"w": torch.zeros(1 << 16)}, policy_version=2, train_state={"x": torch.ones(2)})
""")


def test_sigkill_mid_save_on_s3_keeps_previous_version(s3_endpoint, s3_bucket):
    env = dict(os.environ, PYTHONPATH=str(REPO), AWS_ENDPOINT_URL=s3_endpoint.endpoint,
               AWS_ACCESS_KEY_ID=s3_endpoint.key, AWS_SECRET_ACCESS_KEY=s3_endpoint.secret)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, s3_bucket], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "KILLME"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    fs = s3fs.S3FileSystem(**s3_endpoint.storage_options)
    assert fs.exists(f"{s3_bucket}/run/step-00000002/model.safetensors")  # the kill hit mid-version
    store = CheckpointStore(s3_bucket, "run", storage_options=s3_endpoint.storage_options)
    assert [r.step for r in store.versions()] == [1]
    assert torch.equal(store.load().weights["w"], torch.ones(1 << 16))


def test_resume_from_s3_is_bit_exact(s3_endpoint, s3_bucket):
    cfg = TrainConfig(lr=2e-2, micro_batch_size=2, num_updates_per_batch=2, ema_decay=0.9, old_logp_source="replay")
    data = [rollout(ToyPolicy(seed=100 + k), 4, seed=k) for k in range(2)]
    p_ref = ToyPolicy(seed=0, dropout=0.3)
    be_ref = TrainBackend(p_ref, ToyGRPO(), cfg)
    want = [be_ref.step(b) for b in data][-1]

    p1 = ToyPolicy(seed=0, dropout=0.3)
    be1 = TrainBackend(p1, ToyGRPO(), cfg)
    be1.step(data[0])
    store = CheckpointStore(s3_bucket, "run", storage_options=s3_endpoint.storage_options)
    ref = save_train_checkpoint(store, be1, config=cfg)
    torch.rand(100)
    p2 = ToyPolicy(seed=0, dropout=0.3)
    be2 = TrainBackend(p2, ToyGRPO(), cfg)
    restore_train_checkpoint(be2, ref, storage_options=s3_endpoint.storage_options)
    got = be2.step(data[1])
    assert (got.loss, got.grad_norms, got.metrics) == (want.loss, want.grad_norms, want.metrics)
    for (n, a), b in zip(p_ref.module.named_parameters(), p2.module.parameters()):
        assert torch.equal(a, b), n
