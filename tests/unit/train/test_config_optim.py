import math

import pytest

from unirl_core.errors import ConfigError
from unirl_core.train import TrainConfig, lr_factor


@pytest.mark.parametrize("bad", [
    {"lr": 0.0}, {"lr": float("nan")}, {"betas": (0.9, 1.0)}, {"weight_decay": -1.0}, {"micro_batch_size": 0},
    {"num_updates_per_batch": 0}, {"old_logp_source": "cache"},
    {"ema_decay": 1.0}, {"schedule": "cosine"}, {"schedule": "linear", "total_steps": 5, "warmup_steps": 5},
    {"max_grad_norm": 0.0}, {"shard": "sometimes"}, {"weights_scope": "lora"}, {"min_lr_ratio": 2.0},
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
