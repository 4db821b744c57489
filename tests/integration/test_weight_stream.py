"""``StreamReceiver``: the trainer -> engine broadcast into a model that loads weights itself (a vLLM worker).

Sender and receiver are real gloo ranks on 127.0.0.1 (the sender on a thread of this process, as the pool's
trainer actor and a server's worker are two processes that both block in the same collectives)."""

import socket
import threading

import pytest
import torch

from unirl_core.weightsync.stream import StreamReceiver
from unirl_core.weightsync.sync import WeightSender, WeightSyncConfig, WeightSyncError

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(50, 16, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g),
            "model.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16)}


def _pair(**kw):
    """A connected (sender, receiver) pair; the receiver expects ``_state``'s names and shapes."""
    cfg = WeightSyncConfig(master_port=_free_port(), timeout_s=30, bucket_mb=0.002, direct_mb=1.0)
    expected = {k: tuple(v.shape) for k, v in _state(0).items()}
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("tx", WeightSender(cfg)))
    t.start()
    rx = StreamReceiver(cfg, expected=expected, **kw)
    t.join()
    return box["tx"], rx


def _send(tx, state, version):
    """Send on a thread; returns (thread, box) where box gets 'stats' or 'error'."""
    box = {}

    def run():
        try:
            box["stats"] = tx.send(state, version)
        except Exception as e:  # noqa: BLE001 - asserted by the test
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, box


def _close(tx, rx) -> None:
    """The sender closes the stream: the receiver's next ``receive`` returns None."""
    t = threading.Thread(target=tx.close)
    t.start()
    assert rx.receive(lambda it: list(it)) is None
    t.join()


def test_stream_delivers_every_tensor_bitwise_bucket_by_bucket_and_failures_reach_the_sender():
    tx, rx = _pair()
    try:
        # 1: a consumer that loads everything: the same bits, several buckets, the sender's final vote passes
        state = _state(1)
        got, calls = {}, []
        t, box = _send(tx, state, 1)
        stats = rx.receive(lambda it: calls.append(got.update({n: v.clone() for n, v in it})))
        t.join()
        assert "error" not in box and box["stats"].version == 1 == stats.version == rx.version
        assert len(calls) == 1 and stats.num_buckets >= 3 and stats.num_tensors == 3
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
        assert got["model.norm.weight"].dtype == torch.bfloat16
        # 2: a loader that fails half-way: the rest of the buckets are still taken, both sides raise, nobody hangs
        def broken(it):
            next(it)
            raise RuntimeError("layer 0 did not fit")
        t, box = _send(tx, _state(2), 2)
        with pytest.raises(WeightSyncError, match=r"weight_sync\.load.*RuntimeError.*layer 0 did not fit"):
            rx.receive(broken)
        t.join()
        assert isinstance(box["error"], WeightSyncError) and "failed to load it" in str(box["error"])
        assert rx.version == 1
        # 3: a header the served checkpoint does not fit: refused before any bucket, both sides raise
        wrong = {**_state(3), "lm_head.weight": torch.zeros(50, 16)}
        t, box = _send(tx, wrong, 3)
        with pytest.raises(WeightSyncError, match=r"weight_sync\.tensors.*lm_head\.weight"):
            rx.receive(lambda it: list(it))
        t.join()
        assert isinstance(box["error"], WeightSyncError) and "refused" in str(box["error"])
        # 4: the group is still in lockstep: the next sync loads
        state = _state(4)
        got = {}
        t, box = _send(tx, state, 4)
        rx.receive(lambda it: got.update({n: v.clone() for n, v in it}))
        t.join()
        assert "error" not in box and rx.version == 4 and all(torch.equal(got[k], state[k]) for k in state)
        _close(tx, rx)  # 5: the sender closes the stream
    finally:
        rx.close()


def test_a_tied_head_may_be_sent_and_a_missing_tensor_is_refused():
    tx, rx = _pair(optional={"lm_head.weight": (50, 16)})
    try:
        state = {**_state(5), "lm_head.weight": torch.ones(50, 16)}
        t, box = _send(tx, state, 5)
        names = []
        rx.receive(lambda it: names.extend(n for n, _ in it))
        t.join()
        assert "error" not in box and sorted(names) == sorted(state)
        partial = {k: v for k, v in _state(6).items() if k != "model.norm.weight"}
        t, box = _send(tx, partial, 6)
        with pytest.raises(WeightSyncError, match=r"model\.norm\.weight.*a tensor for every checkpoint entry"):
            rx.receive(lambda it: list(it))
        t.join()
        assert isinstance(box["error"], WeightSyncError)
        shaped = {**_state(7), "model.norm.weight": torch.zeros(8)}
        t, box = _send(tx, shaped, 7)
        with pytest.raises(WeightSyncError, match=r"model\.norm\.weight'\]\.shape.*\(8,\).*\(16,\)"):
            rx.receive(lambda it: list(it))
        t.join()
        _close(tx, rx)
    finally:
        rx.close()
