import math

import pytest

from unirl_core.errors import ConfigError
from unirl_core.train import TrainConfig, lr_factor


@pytest.mark.parametrize("bad", [
    {"lr": 0.0}, {"lr": float("nan")}, {"betas": (0.9, 1.0)}, {"weight_decay": -1.0}, {"micro_batch_size": 0},
    {"num_updates_per_batch": 0}, {"old_logp_source": "cache"},
    {"ema_decay": 1.0}, {"schedule": "cosine"}, {"schedule": "linear", "total_steps": 5, "warmup_steps": 5},
    {"max_grad_norm": 0.0}, {"shard": "sometimes"}, {"optimizer_impl": "apex"}, {"weights_scope": "lora"},
    {"min_lr_ratio": 2.0},
])
def test_config_rejects_bad_fields(bad):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**bad)
    assert "train." in str(e.value)


def test_warmup_then_constant_golden():
    cfg = TrainConfig(warmup_steps=4)
    assert [lr_factor(s, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_golden():
    cfg = TrainConfig(warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    got = [lr_factor(s, cfg) for s in range(8)]
    # after warmup: progress 0, 1/4, 1/2, 3/4, 1, then held at the floor
    want = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75, 1.0, 1.0)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[4] == pytest.approx(0.55)
    assert got[-1] == pytest.approx(0.1)


def test_linear_golden():
    cfg = TrainConfig(schedule="linear", total_steps=4)
    assert [lr_factor(s, cfg) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_removed_mixed_precision_key_names_the_replacement():
    from unirl_core.config.loader import from_dict

    with pytest.raises(ConfigError, match="model dtype|model.dtype") as e:
        from_dict(TrainConfig, {"mixed_precision": "bf16"}, "train")
    assert "train.mixed_precision" in str(e.value)


def test_optimizer_impl_auto_is_foreach_on_cpu_and_fused_on_request():
    """``auto`` keeps CPU runs on the foreach kernel (their trajectories unchanged); ``fused`` is one kernel whose
    update matches foreach's to rounding and whose state resumes under either kernel."""
    import torch

    from unirl_core.train.optim import build_optimizer, optimizer_impl

    def run(impl, state=None, steps=3):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 32))
        opt = build_optimizer([w], TrainConfig(lr=1e-2, optimizer_impl=impl))
        if state is not None:
            opt.load_state_dict(state)
        for i in range(steps):
            w.grad = torch.sin(w.detach() * (i + 1))
            opt.step()
        return w.detach().clone(), opt

    auto_w, auto_opt = run("auto")
    assert optimizer_impl(auto_opt.param_groups[0]["params"], TrainConfig()) == "foreach"
    assert auto_opt.defaults["foreach"] is True and not auto_opt.defaults["fused"]
    fused_w, fused_opt = run("fused")
    assert fused_opt.defaults["fused"] is True
    assert torch.allclose(fused_w, auto_w, rtol=0, atol=1e-6)
    foreach_w, _ = run("foreach")
    assert torch.equal(foreach_w, auto_w)
    # a state written by one kernel resumes under the other (same keys: step, exp_avg, exp_avg_sq)
    _, resumed = run("fused", state=auto_opt.state_dict(), steps=1)
    assert int(resumed.state_dict()["state"][0]["step"]) == 4
