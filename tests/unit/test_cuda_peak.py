"""benchmarks/cuda_peak.py's replay on a hand-made allocator history (the GPU run is its real use)."""

from benchmarks.cuda_peak import analyse

MIB = 2**20


def _ev(action, addr, size, where):
    frames = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": f"/x/unirl_core/{where}.py", "line": 7, "name": where}]
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_peak_is_found_and_its_live_allocations_are_named():
    traces = [
        _ev("alloc", 1, 10 * MIB, "weights"),
        _ev("alloc", 2, 4 * MIB, "grads"),
        _ev("alloc", 3, 6 * MIB, "logits"),   # peak: 10 + 4 + 6 (+ 5 before the window)
        _ev("free_completed", 3, 6 * MIB, "logits"),
        _ev("alloc", 4, 3 * MIB, "snapshot"),
        _ev("free_requested", 4, 3 * MIB, "snapshot"),  # not counted: the block is freed at free_completed
        _ev("free_completed", 4, 3 * MIB, "snapshot"),
    ]
    allocated_now = (5 + 10 + 4) * MIB
    text = analyse({"device_traces": [traces]}, allocated_now)
    assert "before the window: 5.0 MiB" in text
    assert "peak allocated: 25.0 MiB at event 2" in text
    lines = text.splitlines()
    owners = [ln for ln in lines if "unirl_core/" in ln and "set the peak" not in ln]
    assert [ln.split()[0] for ln in owners] == ["10.0", "6.0", "4.0"]  # largest first, torch frames skipped
    assert "unirl_core/weights.py:7 weights" in owners[0] and "torch/nn" not in owners[0]
    assert "snapshot" not in "\n".join(owners)  # freed before the peak
    assert "set the peak: 6.0 MiB at unirl_core/logits.py:7 logits" in text
