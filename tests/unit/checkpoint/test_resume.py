"""Resume restores the exact training state: the next step is bit-identical to the uninterrupted run's."""

import dataclasses

import pytest
import torch

from tests.unit.train.toy import ToyGRPO, ToyPolicy, rollout
from unirl_core.checkpoint import CheckpointStore, restore_train_checkpoint, save_train_checkpoint
from unirl_core.errors import CheckpointError
from unirl_core.train import TrainBackend, TrainConfig

CFG = TrainConfig(lr=2e-2, micro_batch_size=2, num_updates_per_batch=2, warmup_steps=2, schedule="cosine",
                  total_steps=20, max_grad_norm=0.5, weight_decay=0.01, ema_decay=0.9, old_logp_source="replay",
                  seed=3)


def backend(cfg=CFG):
    # dropout inside the loss makes the next step depend on the global RNG, so RNG restore is exercised
    policy = ToyPolicy(seed=0, dropout=0.3)
    return policy, TrainBackend(policy, ToyGRPO(), cfg)


def batches():
    return [rollout(ToyPolicy(seed=100 + k), 6, seed=k) for k in range(3)]


def params(policy):
    return {n: p.detach().clone() for n, p in policy.module.named_parameters()}


def test_resumed_next_step_is_bit_identical(tmp_path):
    data = batches()
    p_ref, be_ref = backend()
    ref_metrics = [be_ref.step(b) for b in data]

    p1, be1 = backend()
    for b in data[:2]:
        be1.step(b)
    store = CheckpointStore(str(tmp_path), "run")
    ref = save_train_checkpoint(store, be1, config=CFG, extra={"tracker": {"p0": [0.5, 1.5]}})
    assert (ref.step, ref.policy_version) == (2, 2)

    torch.rand(1000)  # the process moves on: RNG state drifts
    p2, be2 = backend()
    with torch.no_grad():
        for p in p2.module.lora.parameters():
            p.add_(1.0)  # a fresh process holds other weights until restore
    loaded = restore_train_checkpoint(be2, store.latest())
    assert loaded.extra == {"tracker": {"p0": [0.5, 1.5]}} and loaded.config["lr"] == CFG.lr
    m = be2.step(data[2])

    want = ref_metrics[2]
    assert (m.loss, m.grad_norms, m.lr, m.metrics) == (want.loss, want.grad_norms, want.lr, want.metrics)
    assert (m.step, m.optimizer_steps) == (want.step, want.optimizer_steps) == (3, 6)
    for name, t in params(p_ref).items():
        assert torch.equal(params(p2)[name], t), name
    for a, b in zip(be_ref.ema.shadow, be2.ema.shadow):
        assert torch.equal(a, b)
    sa, sb = be_ref.optimizer.state_dict()["state"], be2.optimizer.state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) and torch.equal(sa[k]["step"], sb[k]["step"])


def test_full_weights_scope_round_trips_frozen_parameters(tmp_path):
    cfg = TrainConfig(weights_scope="full", micro_batch_size=2)
    p1, be1 = backend(cfg)
    be1.step(batches()[0])
    store = CheckpointStore(str(tmp_path), "run")
    ref = save_train_checkpoint(store, be1)
    got = store.load(ref).weights
    assert set(got) == {n for n, _ in p1.module.named_parameters()}
    assert torch.equal(got["base.0.weight"], p1.module.base[0].weight)


def test_resume_into_another_layout_fails_loudly(tmp_path):
    _, be1 = backend(TrainConfig(micro_batch_size=2))
    be1.step(batches()[0])
    store = CheckpointStore(str(tmp_path), "run")
    ref = save_train_checkpoint(store, be1)
    other = ToyPolicy(seed=0, hidden=8)
    be2 = TrainBackend(other, ToyGRPO(), TrainConfig(micro_batch_size=2, ema_decay=0.9))
    with pytest.raises(CheckpointError, match="shapes"):
        restore_train_checkpoint(be2, ref)


@pytest.mark.parametrize("scope", ["trainable", "full"])
def test_background_weights_version_holds_the_weights_at_save(tmp_path, scope):
    """The writer's staging path (``model_state_dict(staging=...)``; on a CPU trainer the tensors are the live
    parameters, cloned by the snapshot): the next step's in-place update, right after the save returns, does not
    reach the version being written; the written weights are the ones the synchronous path writes."""
    from unirl_core.checkpoint.store import load_weights
    from unirl_core.checkpoint.writer import VersionWriter

    cfg = dataclasses.replace(CFG, weights_scope=scope)
    _, be = backend(cfg)
    be.step(batches()[0])
    sync = save_train_checkpoint(CheckpointStore(str(tmp_path / "sync"), "run"), be, full_state=False)
    writer = VersionWriter()
    ref = save_train_checkpoint(CheckpointStore(str(tmp_path / "bg"), "run"), be, full_state=False, publish=False,
                                writer=writer)
    assert writer.staging.fence() == []  # a CPU trainer stages nothing on a device
    with torch.no_grad():
        for p in be.policy.module.parameters():
            p.add_(1.0)  # the next step's update while the version is written
    writer.wait()
    want, got = load_weights(sync), load_weights(ref)
    assert set(got) == set(want) and len(got) > 0
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def _no_step_while(be, fn):
    """Run ``fn`` with the backend's optimizer refusing to step: loading must not run one."""
    def refuse(*_a, **_k):
        raise AssertionError("the optimizer stepped while a checkpoint was loaded")
    real = be.optimizer.step
    be.optimizer.step = refuse
    try:
        return fn()
    finally:
        be.optimizer.step = real


def test_step0_version_holds_a_fresh_optimizer_and_the_first_update_is_adamws_first(tmp_path):
    """A version written before any update holds no optimizer state, writing it leaves the live optimizer
    fresh, and restoring it does not step: the first update bias-corrects with step 1, as plain AdamW
    (torch's get_optimizer_state_dict would run one zero-gradient step first: the first update ~0.74x)."""
    cfg = dataclasses.replace(CFG, num_updates_per_batch=1, warmup_steps=0, schedule="constant", ema_decay=None,
                              max_grad_norm=None, weight_decay=0.0)
    data = batches()[0]
    store = CheckpointStore(str(tmp_path), "run")
    p0, be0 = backend(cfg)
    ref = _no_step_while(be0, lambda: save_train_checkpoint(store, be0, config=cfg, extra={}))
    assert not be0.optimizer.state
    p1, be1 = backend(cfg)
    _no_step_while(be1, lambda: restore_train_checkpoint(be1, ref))
    assert not be1.optimizer.state

    # the same update by a plain torch AdamW on the gradients the backend's optimizer saw
    seen = {}
    real = be1.optimizer.step

    def record_then_step(*a, **k):
        for n, p in zip(be1.param_names, be1.params):
            seen[n] = (p.detach().clone(), None if p.grad is None else p.grad.detach().clone())
        return real(*a, **k)

    be1.optimizer.step = record_then_step
    be1.step(data)
    assert all(float(s["step"]) == 1.0 for s in be1.optimizer.state.values())
    ref_params = {}
    for n, (w, g) in seen.items():
        ref_params[n] = w.clone().requires_grad_(True)
        ref_params[n].grad = g
    assert any(g is not None and g.abs().sum() > 0 for _, g in seen.values())
    opt = torch.optim.AdamW(list(ref_params.values()), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0)
    opt.step()
    for n, p in zip(be1.param_names, be1.params):
        assert torch.equal(p.detach(), ref_params[n].detach()), n


def test_restore_of_a_trained_state_loads_it_without_stepping(tmp_path):
    """Restoring a non-empty state into a fresh backend loads the saved moments bitwise, with no zero-gradient
    step first (torch's set_optimizer_state_dict takes one on a fresh optimizer: a transient copy of the
    gradients and of the whole optimizer state)."""
    data = batches()
    p1, be1 = backend()
    for b in data[:2]:
        be1.step(b)
    store = CheckpointStore(str(tmp_path), "run")
    ref = save_train_checkpoint(store, be1, config=CFG, extra={})
    p2, be2 = backend()
    _no_step_while(be2, lambda: restore_train_checkpoint(be2, ref))
    sa, sb = be1.optimizer.state_dict(), be2.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for key, v in sa["state"][k].items():
            assert torch.equal(v, sb["state"][k][key]), (k, key)
