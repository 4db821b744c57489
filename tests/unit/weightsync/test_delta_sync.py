"""Deltas on the wire between two processes (gloo on CPU; the same code runs over NCCL): versions sent as deltas
leave the receiver bitwise equal to full sends, tied weights included; a receiver whose weights changed since falls
back to full weights; a delta that does not reproduce the sender's digest is reported naming the tensor and the
same sync sends the version in full; full weights that do not reproduce it fail loudly on both ends; a sparse change
costs its positions and values only."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from unirl_core.weightsync import delta as wire_delta
from unirl_core.weightsync.sync import WeightSender, WeightSyncConfig, WeightSyncError

pytestmark = pytest.mark.slow  # a second Python process (~3 s)

REPO = Path(__file__).resolve().parents[3]
MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        '''A bf16 embedding tied to the LM head (two names, one tensor) and an fp32 norm.'''

        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.emb = nn.Embedding(64, 16).to(torch.bfloat16)
            self.head = nn.Linear(16, 64, bias=False).to(torch.bfloat16)
            self.head.weight = self.emb.weight
            self.norm = nn.LayerNorm(16)
""")
RECEIVER = MODEL + textwrap.dedent("""
    import sys
    from pathlib import Path
    from unirl_core.weightsync.sync import WeightReceiver, WeightSyncConfig, WeightSyncError

    out, port = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    module = Tiny(seed=7)  # another init than the sender's
    got, errors = {}, {}
    with WeightReceiver(WeightSyncConfig(master_port=port, timeout_s=60), module) as rx:
        while True:
            try:
                stats = rx.receive()
            except WeightSyncError as e:
                errors[len(got) + len(errors)] = str(e)
                continue
            if stats is None:
                break
            got[stats.version] = {"delta": stats.delta, "bytes": stats.bytes, "held": rx.held,
                                  "resent": stats.resent_full,
                                  "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}
            with torch.no_grad():
                if stats.version == 3:  # changed outside the sync, and the receiver told: v4 travels in full
                    module.norm.bias[0] += 1
                    rx.forget()
                if stats.version == 4:  # changed outside the sync, the receiver NOT told: v5's delta fails
                    module.norm.weight[3] += 1
    torch.save({"got": got, "errors": errors}, out / "received.pt")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wrong_digest(digest):
    """``wire_delta.tensor_digest`` off by one for 16-element fp32 tensors (the sender digests the tensors that
    changed: the norm bias at v9): its record of what it sent disagrees with the bytes, so nothing reproduces it,
    full weights included."""
    def wrong(t):
        d = digest(t)
        return [d[0] + 1, *d[1:]] if t.dtype == torch.float32 and t.shape == (16,) else d
    return wrong


def _tiny():
    ns: dict = {}
    exec(MODEL, ns)  # the receiver's model class, so both ends build the same architecture
    return ns["Tiny"](seed=0)


def _corrupting(encode):
    """``wire_delta.encode`` that flips one bit of the first changed fp32 value it encodes (a damaged delta)."""
    def corrupt(new, old):
        mode, k, pieces = encode(new, old)
        if mode != "dense" and k and new.dtype == torch.float32:
            wire_delta.bits(pieces[1])[0] ^= 1
        return mode, k, pieces
    return corrupt


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """Sender here, receiver in a second process: versions 0..9 with the changes each test checks."""
    torch.set_num_threads(1)
    out, port = tmp_path_factory.mktemp("delta_sync"), _free_port()
    (out / "receiver.py").write_text(RECEIVER)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(out / "receiver.py"), str(out), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    module = _tiny()
    state = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}
    g = torch.Generator().manual_seed(3)
    sent, stats, failures = {}, {}, {}
    changes = {
        1: lambda: state["emb.weight"].view(-1).index_add_(0, torch.tensor([5, 300, 1000]),
                                                          torch.ones(3, dtype=torch.bfloat16)),  # 3 of 1024: positions
        2: lambda: (state["emb.weight"].view(-1)[:60].add_(1), state["norm.weight"][:10].add_(1),
                    state["norm.bias"].add_(1)),                                        # bitmap, bitmap, dense
        3: lambda: state["emb.weight"][7, 2].add_(1),
        4: lambda: state["emb.weight"][8, 2].add_(1),
        5: lambda: state["emb.weight"][9, 2].add_(1),
        6: lambda: state["emb.weight"][10, 2].add_(1),
        7: lambda: state["norm.weight"].index_add_(0, torch.tensor([1, 2]), torch.rand(2, generator=g) + 0.5),
        8: lambda: state["emb.weight"][11, 2].add_(1),
        9: lambda: state["norm.bias"][0].add_(1),
    }
    try:
        with torch.no_grad(), WeightSender(WeightSyncConfig(master_port=port, timeout_s=60), deltas=True) as tx:
            for v in range(10):
                if v in changes:
                    changes[v]()
                encode, digest = wire_delta.encode, wire_delta.tensor_digest
                if v == 7:
                    wire_delta.encode = _corrupting(encode)
                if v == 9:
                    wire_delta.tensor_digest = _wrong_digest(digest)
                try:
                    stats[v] = tx.send(state, v)
                except WeightSyncError as e:
                    failures[v] = str(e)
                finally:
                    wire_delta.encode, wire_delta.tensor_digest = encode, digest
                sent[v] = {k: t.clone() for k, t in state.items()}
    finally:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return {"sent": sent, "stats": stats, "failures": failures, **torch.load(out / "received.pt")}


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(wire_delta.bits(a[k]), wire_delta.bits(b[k])) for k in a)


def test_versions_sent_as_deltas_equal_full_sends_bitwise(session):
    got, sent, stats = session["got"], session["sent"], session["stats"]
    assert [stats[v].delta for v in (0, 1, 2, 3)] == [False, True, True, True]
    for v in (0, 1, 2, 3):
        assert got[v]["delta"] == stats[v].delta
        assert _bitwise(got[v]["state"], sent[v]), v  # version 0 came in full: the deltas equal full sends
    assert torch.equal(got[3]["state"]["head.weight"], got[3]["state"]["emb.weight"])  # still tied


def test_a_sparse_change_costs_its_positions_and_values(session):
    stats = session["stats"]
    full = 2 * 64 * 16 * 2 + 2 * 16 * 4  # emb + its tied head (bf16), norm weight + bias (fp32)
    assert stats[0].bytes == full
    # v1: 3 changed bf16 elements under each of the two tied names, as positions (4 bytes) + values (2 bytes)
    assert stats[1].bytes == 2 * 3 * (4 + 2)
    # v2: 60 of 1024 (bitmap 128 + values), 10 of 16 fp32 (bitmap 2 + values), all 16 (dense)
    assert stats[2].bytes == 2 * (128 + 60 * 2) + (2 + 10 * 4) + 16 * 4
    assert stats[1].bytes < full and stats[1].header_bytes > 0


def test_a_receiver_that_changed_since_gets_full_weights(session):
    got, sent, stats = session["got"], session["sent"], session["stats"]
    assert not stats[4].delta and not got[4]["delta"]  # the receiver forgot its base after v3
    assert stats[4].bytes == stats[0].bytes
    assert _bitwise(got[4]["state"], sent[4])


def test_a_delta_on_another_base_is_resent_in_full_in_the_same_sync(session):
    got, sent, stats, errors = session["got"], session["sent"], session["stats"], session["errors"]
    assert 5 not in errors and 5 not in session["failures"]
    assert not stats[5].delta and stats[5].resent_full == "1 engine(s) did not apply or reproduce the delta"
    assert "weight_sync.tensors['norm.weight'].digest" in got[5]["resent"]  # the receiver's own error names it
    assert _bitwise(got[5]["state"], sent[5])  # the module changed outside the sync is overwritten
    assert stats[5].bytes == stats[3].bytes + stats[0].bytes  # the delta, then the full version
    assert stats[6].delta and _bitwise(got[6]["state"], sent[6])  # it holds v5 bitwise: deltas again


def test_a_damaged_delta_is_resent_in_full(session):
    got, sent, stats = session["got"], session["sent"], session["stats"]
    assert 7 not in session["errors"] and not stats[7].delta and stats[7].resent_full
    assert "weight_sync.tensors['norm.weight'].digest" in got[7]["resent"]
    assert _bitwise(got[7]["state"], sent[7])
    assert stats[8].delta and _bitwise(got[8]["state"], sent[8])
    assert got[8]["held"] is not None and got[8]["held"][0] == 8


def test_full_weights_that_miss_the_digest_fail_loudly_on_both_ends(session):
    got, stats, errors, failures = session["got"], session["stats"], session["errors"], session["failures"]
    assert 9 not in got and 9 not in stats
    assert "weight_sync.tensors['norm.bias'].digest" in errors[9]  # after the full resend failed too
    assert "weight_sync.load" in failures[9] and "failed to load it" in failures[9]
