"""FSDP2 on 2 CPU processes (gloo, launched by torchrun) equals world size 1 on the same data."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.unit.train.toy import ToyGRPO, ToyPolicy, rollout
from unirl_core.checkpoint import CheckpointStore, restore_train_checkpoint
from unirl_core.train import TrainBackend, TrainConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CFG = dict(lr=5e-2, micro_batch_size=2, num_updates_per_batch=2, warmup_steps=1, max_grad_norm=0.5,
           weight_decay=0.01, ema_decay=0.9, old_logp_source="replay", fsdp_wrap_classes=("Sequential",))

WORKER = textwrap.dedent("""
    import sys, torch
    from tests.unit.train.toy import ToyGRPO, ToyPolicy, rollout
    from unirl_core.checkpoint import CheckpointStore, restore_train_checkpoint, save_train_checkpoint
    from unirl_core.train import TrainBackend, TrainConfig, init_distributed
    from unirl_core.train.distributed import is_sharded

    out, root, cfg_kw = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    torch.set_num_threads(1)
    info = init_distributed("cpu")  # the toy model is a CPU model, also on a host with CUDA
    policy = ToyPolicy(seed=0)
    be = TrainBackend(policy, ToyGRPO(), TrainConfig(**cfg_kw), dist_info=info)
    batches = [rollout(ToyPolicy(seed=100 + k), 8, seed=k) for k in range(2)]
    m1 = be.step(batches[0])
    ref = save_train_checkpoint(CheckpointStore(root, "fsdp"), be)
    m2 = be.step(batches[1])
    weights = be.model_state_dict()
    ema = be.state_dict()["ema"]
    # a fresh sharded backend restored from the step-1 checkpoint continues exactly like the live one
    fresh = ToyPolicy(seed=0)
    be_r = TrainBackend(fresh, ToyGRPO(), TrainConfig(**cfg_kw), dist_info=info)
    restore_train_checkpoint(be_r, ref)
    m2_r = be_r.step(batches[1])
    weights_r = be_r.model_state_dict()
    if info.rank == 0:
        torch.save({"metrics": [m1.as_dict(), m2.as_dict()], "weights": weights, "ema": ema,
                    "sharded": is_sharded(policy.module), "world": info.world_size, "ref_step": ref.step,
                    "resumed_metrics": m2_r.as_dict(), "resumed_weights": weights_r}, out)
    torch.distributed.destroy_process_group()
    # torch 2.13's gloo teardown sometimes aborts at interpreter exit after all work is done ("terminate
    # called without an active exception", ~1 run in 7 on 2 busy cores): leave without static destructors
    import os
    os._exit(0)
""")


def test_two_rank_fsdp_step_equals_world_size_one(tmp_path):
    out = tmp_path / "rank0.pt"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(out), str(tmp_path / "ckpt"), repr(CFG)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=True)
    assert got["sharded"] and got["world"] == 2
    for key in ("loss", "grad_norm", "ratio_mean"):
        assert got["resumed_metrics"][key] == got["metrics"][1][key], key
    for name, t in got["weights"].items():
        assert torch.equal(got["resumed_weights"][name], t), name

    policy = ToyPolicy(seed=0)
    be = TrainBackend(policy, ToyGRPO(), TrainConfig(**CFG))
    assert not be.sharded
    batches = [rollout(ToyPolicy(seed=100 + k), 8, seed=k) for k in range(2)]
    want = [be.step(b).as_dict() for b in batches]
    for g, w in zip(got["metrics"], want):
        for key in ("loss", "grad_norm", "lr", "ratio_mean", "clip_frac", "optimizer_steps"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
    trained = {n: p.detach() for n, p in policy.module.named_parameters() if p.requires_grad}
    assert set(got["weights"]) == set(trained)
    for name, t in trained.items():
        torch.testing.assert_close(got["weights"][name], t, rtol=1e-5, atol=1e-6, msg=name)
    for name, s in zip(be.ema.names, be.ema.shadow):
        torch.testing.assert_close(got["ema"][name], s, rtol=1e-5, atol=1e-6, msg=name)

    # the checkpoint the 2 ranks wrote after step 1 resumes on one process and continues identically
    store = CheckpointStore(str(tmp_path / "ckpt"), "fsdp")
    assert store.latest().step == got["ref_step"] == 1
    policy1 = ToyPolicy(seed=0)
    be1 = TrainBackend(policy1, ToyGRPO(), TrainConfig(**CFG))
    restore_train_checkpoint(be1, store.latest())
    m = be1.step(batches[1])
    assert m.loss == pytest.approx(want[1]["loss"], rel=1e-5)
    for name, p in policy1.module.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.detach(), trained[name], rtol=1e-5, atol=1e-6, msg=name)
