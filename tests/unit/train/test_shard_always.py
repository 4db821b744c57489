"""shard='always': FSDP2 at world size 1 (a single-rank gloo group) trains exactly like a plain module.

Runs in a subprocess because the single-rank group is process-global state."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.unit.train.toy import ToyGRPO, ToyPolicy, rollout
from unirl_core.train import TrainBackend, TrainConfig

REPO = Path(__file__).resolve().parents[3]
CFG = {"lr": 5e-2, "micro_batch_size": 2, "num_updates_per_batch": 2, "max_grad_norm": 0.5,
       "old_logp_source": "replay", "fsdp_wrap_classes": ("Sequential",)}

WORKER = textwrap.dedent("""
    import sys, torch
    import torch.distributed as dist
    from tests.unit.train.toy import ToyGRPO, ToyPolicy, rollout
    from unirl_core.train import TrainBackend, TrainConfig
    from unirl_core.train.distributed import is_sharded
    from unirl_core.weightsync.sync import gather_for_sync

    torch.set_num_threads(1)
    policy = ToyPolicy(seed=0)
    be = TrainBackend(policy, ToyGRPO(), TrainConfig(shard="always", **eval(sys.argv[2])))
    metrics = [be.step(rollout(ToyPolicy(seed=100 + k), 8, seed=k)).as_dict() for k in range(2)]
    torch.save({"sharded": is_sharded(policy.module), "world": dist.get_world_size(), "metrics": metrics,
                "weights": be.model_state_dict(), "sync": gather_for_sync(policy.module, "full")}, sys.argv[1])
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_shard_always_world_one_matches_plain_module(tmp_path):
    script, out = tmp_path / "worker.py", tmp_path / "out.pt"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(script), str(out), repr(CFG)], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=True)
    assert got["sharded"] and got["world"] == 1

    policy = ToyPolicy(seed=0)
    be = TrainBackend(policy, ToyGRPO(), TrainConfig(shard="never", **CFG))
    assert not be.sharded
    want = [be.step(rollout(ToyPolicy(seed=100 + k), 8, seed=k)).as_dict() for k in range(2)]
    for g, w in zip(got["metrics"], want):
        for key in ("loss", "grad_norm", "ratio_mean"):
            assert g[key] == w[key], key
    plain = be.model_state_dict()
    assert set(got["weights"]) == set(plain)
    for name, t in plain.items():
        assert torch.equal(got["weights"][name], t), name
    # the weight-sync sender gathers full (unsharded) tensors from the FSDP module
    full = policy.module.state_dict()
    assert set(got["sync"]) == set(full)
    for name, t in full.items():
        assert torch.equal(got["sync"][name], t), name
