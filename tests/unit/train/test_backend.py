import copy

import pytest
import torch

from tests.unit.train.toy import ToyGRPO, ToyPolicy, rollout, step_log_probs
from unirl_core.errors import ConfigError, NumericsError
from unirl_core.train import TrainBackend, TrainConfig, lr_factor


def make(cfg: TrainConfig, seed: int = 0, **policy_kw):
    policy = ToyPolicy(seed=seed, **policy_kw)
    algo = ToyGRPO()
    return policy, algo, TrainBackend(policy, algo, cfg)


def lora_params(policy):
    return {n: p.detach().clone() for n, p in policy.module.named_parameters() if p.requires_grad}


def test_micro_batches_in_order_and_pi_old_frozen_once_before_updates():
    policy, algo, be = make(TrainConfig(lr=1e-2, micro_batch_size=2, num_updates_per_batch=3,
                                        old_logp_source="replay"))
    batch = rollout(policy, 5)
    m = be.step(batch)
    chunks = [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert algo.calls[:3] == [("old", c, False) for c in chunks]  # no_grad replay, exactly the micro-batches
    assert algo.calls[3:] == [("loss", c, True) for c in chunks] * 3
    assert (m.step, m.optimizer_steps, len(m.grad_norms), be.policy_version) == (1, 3, 3, 1)


def test_rollout_source_passes_none_and_never_replays():
    policy, algo, be = make(TrainConfig(micro_batch_size=4, num_updates_per_batch=2))
    be.step(rollout(policy, 4))
    assert [c[0] for c in algo.calls] == ["loss", "loss"]
    assert all(c[2] is False for c in algo.calls)


def test_replay_first_update_ratio_is_exactly_one():
    policy, _, be = make(TrainConfig(micro_batch_size=3, old_logp_source="replay"))
    m = be.step(rollout(policy, 6))
    assert (m.metrics["ratio_min"], m.metrics["ratio_max"], m.metrics["clip_frac"]) == (1.0, 1.0, 0.0)


def _reference_loop(policy, batch, cfg, updates):
    """A plain PyTorch loop: whole-batch loss, backward, clip, AdamW, LambdaLR."""
    params = [p for p in policy.module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    algo = ToyGRPO()
    norms = []
    for _ in range(updates):
        out = algo.loss(policy, batch, old_log_probs=None)
        out.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
        opt.step()
        sched.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("n,mb", [(4, 4), (4, 2), (5, 2), (6, 1)])
def test_accumulation_matches_a_plain_full_batch_loop(n, mb):
    cfg = TrainConfig(lr=5e-2, micro_batch_size=mb, num_updates_per_batch=2, warmup_steps=1, max_grad_norm=0.5,
                      weight_decay=0.01)
    policy, _, be = make(cfg)
    batch = rollout(policy, n)
    ref_policy = ToyPolicy(seed=0)
    ref_norms = _reference_loop(ref_policy, batch, cfg, updates=2)
    m = be.step(batch)
    for (name, p), q in zip(lora_params(policy).items(), lora_params(ref_policy).values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert m.grad_norms == pytest.approx(ref_norms, rel=1e-5)
    if mb == n:  # one micro-batch: the same arithmetic in the same order, so bit-identical
        assert all(torch.equal(p, q) for p, q in zip(lora_params(policy).values(), lora_params(ref_policy).values()))


def test_frozen_parameters_never_move_and_lr_follows_schedule():
    cfg = TrainConfig(lr=1e-2, warmup_steps=3, micro_batch_size=4, num_updates_per_batch=2)
    policy, _, be = make(cfg)
    base = copy.deepcopy(policy.module.base.state_dict())
    lrs = [be.step(rollout(policy, 4, seed=k)).lr for k in range(3)]
    # the last update of step k is optimizer step 2k+1
    assert lrs == pytest.approx([1e-2 * lr_factor(2 * k + 1, cfg) for k in range(3)])
    for k, v in policy.module.base.state_dict().items():
        assert torch.equal(v, base[k])


def test_clipping_bounds_the_update_and_reports_the_pre_clip_norm():
    cfg = TrainConfig(lr=1.0, micro_batch_size=4, max_grad_norm=1e-3)
    policy, _, be = make(cfg)
    batch = rollout(policy, 4)
    params = [p for p in policy.module.parameters() if p.requires_grad]
    ToyGRPO().loss(policy, batch, old_log_probs=None).loss.backward()
    want = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    for p in params:
        p.grad = None
    m = be.step(batch)
    assert m.grad_norm == pytest.approx(want, rel=1e-6)
    assert want > 1e-3


def test_ema_tracks_the_formula_and_applies_temporarily():
    decay = 0.5
    policy, _, be = make(TrainConfig(lr=1e-2, micro_batch_size=4, num_updates_per_batch=2, ema_decay=decay))
    names = set(lora_params(policy))
    for k in range(2):
        be.step(rollout(policy, 4, seed=k))
    assert be.ema.num_updates == 4  # one EMA update per optimizer step
    cur = lora_params(policy)
    with be.ema_applied():
        inside = lora_params(policy)
    assert all(torch.equal(v, cur[k]) for k, v in lora_params(policy).items())
    assert not all(torch.equal(inside[k], cur[k]) for k in cur)
    assert all(torch.equal(inside[k], s) for k, s in zip(be.ema.names, be.ema.shadow))
    assert set(be.ema.names) == names


def test_ema_update_golden():
    policy, _, be = make(TrainConfig(lr=1e-2, micro_batch_size=4, ema_decay=0.9))
    before = lora_params(policy)
    be.step(rollout(policy, 4))
    after = lora_params(policy)
    for name, s in zip(be.ema.names, be.ema.shadow):
        torch.testing.assert_close(s, 0.9 * before[name] + 0.1 * after[name], rtol=0, atol=1e-7)


def test_ema_context_requires_the_flag():
    _, _, be = make(TrainConfig())
    with pytest.raises(ConfigError):
        be.ema_applied()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_policy_trains_fp32_masters_and_computes_in_its_dtype(dtype):
    policy = ToyPolicy(seed=0)
    policy.module.to(dtype)
    batch = rollout(policy, 4)  # sampled by the low-precision module itself
    be = TrainBackend(policy, ToyGRPO(), TrainConfig(lr=1e-2, micro_batch_size=2))
    assert be.compute_dtype == dtype and be.scaler.is_enabled() == (dtype == torch.float16)
    assert all(p.dtype == torch.float32 for p in policy.module.parameters() if p.requires_grad)
    assert all(p.dtype == dtype for p in policy.module.base.parameters())
    with be.compute():  # every forward sees the parameters in the compute dtype ...
        assert all(p.dtype == dtype for p in policy.module.parameters())
    assert all(p.dtype == torch.float32 for p in policy.module.lora.parameters())  # ... and the masters stay
    before = lora_params(policy)
    m = be.step(batch)
    # the first update replays exactly what the low-precision rollout computed
    assert m.metrics["ratio_min"] == m.metrics["ratio_max"] == 1.0
    assert torch.isfinite(torch.tensor(m.loss))
    assert any(not torch.equal(before[k], v) for k, v in lora_params(policy).items())


def test_non_finite_gradients_fail_closed():
    policy, _, be = make(TrainConfig(micro_batch_size=4))
    batch = rollout(policy, 4)
    batch.generated[0].segment.latents[1, 0, 0, 0] = float("inf")
    with pytest.raises(NumericsError, match="grad_norm"):
        be.step(batch)


def test_policy_without_trainable_parameters_is_rejected():
    policy = ToyPolicy()
    policy.module.requires_grad_(False)
    with pytest.raises(ConfigError, match="trainable"):
        TrainBackend(policy, ToyGRPO(), TrainConfig())


def test_replayed_log_probs_equal_stored_ones_for_the_toy():
    # guards the fixture itself: replay over a batch of 1 is exactly what rollout recorded
    policy = ToyPolicy()
    batch = rollout(policy, 3)
    for s in batch:
        seg = s.generated.segment
        lp = step_log_probs(policy.module, seg.latents.reshape(1, seg.latents.shape[0], -1))[0]
        assert torch.equal(lp, seg.log_probs)
