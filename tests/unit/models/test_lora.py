import pytest
import torch
from torch import nn

from unirl_core.errors import ConfigError, InvariantError
from unirl_core.models.lora import apply_lora, has_lora, load_lora_state_dict, lora_disabled, lora_state_dict
from tests.unit.models.round_trip import assert_outputs_close, assert_same_weights


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.to_q(x))


def _perturb_lora(m: nn.Module) -> None:
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.fill_(0.5)


def test_apply_lora_starts_as_noop_and_freezes_base():
    torch.manual_seed(0)
    m, x = _Block(), torch.randn(3, 4)
    y0 = m(x)
    apply_lora(m, rank=2, alpha=2, target_modules=["to_q"])
    assert has_lora(m)
    assert torch.equal(m(x), y0)
    trainable = sorted(n for n, p in m.named_parameters() if p.requires_grad)
    assert trainable == ["to_q.lora_A.default.weight", "to_q.lora_B.default.weight"]


def test_adapter_init_follows_the_seed_not_the_global_generator():
    def adapter(seed):
        torch.manual_seed(0)
        m = _Block()
        torch.rand(int(torch.randint(1, 100, ()).item()) if seed is None else 7)  # consume the global generator
        before = torch.random.get_rng_state()
        apply_lora(m, rank=2, alpha=2, target_modules=["to_q"], seed=seed or 0)
        assert torch.equal(torch.random.get_rng_state(), before)  # the global generator is left as it was
        return m.to_q.lora_A.default.weight.detach().clone()

    a, b = adapter(0), adapter(None)  # same seed, different global generator states
    assert torch.equal(a, b)
    assert not torch.equal(a, adapter(3))


def test_lora_disabled_restores_base_and_keeps_requires_grad():
    torch.manual_seed(0)
    m, x = _Block(), torch.randn(3, 4)
    y0 = m(x)
    apply_lora(m, rank=2, alpha=2, target_modules=["to_q"])
    _perturb_lora(m)
    y1 = m(x)
    assert not torch.equal(y1, y0)
    with lora_disabled(m):
        assert torch.equal(m(x), y0)
    assert torch.equal(m(x), y1)
    assert all(p.requires_grad for n, p in m.named_parameters() if "lora_" in n)


def test_state_dict_round_trip_with_canonical_keys():
    torch.manual_seed(0)
    m, x = _Block(), torch.randn(3, 4)
    apply_lora(m, rank=2, alpha=2, target_modules=["to_q"])
    _perturb_lora(m)
    sd = lora_state_dict(m)
    assert sorted(sd) == ["to_q.lora_A.weight", "to_q.lora_B.weight"]
    m2 = _Block()
    apply_lora(m2, rank=2, alpha=2, target_modules=["to_q"])
    m2.load_state_dict({k: v for k, v in m.state_dict().items() if "lora_" not in k}, strict=False)
    load_lora_state_dict(m2, sd)
    assert_same_weights(m2, m)
    with torch.no_grad():  # two module instances: equal weights, outputs equal up to kernel choice
        assert_outputs_close(m2(x), m(x))


def test_errors():
    m = _Block()
    with pytest.raises(ConfigError, match="target_modules"):
        apply_lora(m, rank=2, alpha=2, target_modules=["nope"])
    with pytest.raises(ConfigError, match="rank"):
        apply_lora(m, rank=0, alpha=2, target_modules=["to_q"])
    with pytest.raises(InvariantError):
        lora_state_dict(m)
    apply_lora(m, rank=2, alpha=2, target_modules=["to_q"])
    with pytest.raises(InvariantError, match="missing"):
        load_lora_state_dict(m, {})
    sd = lora_state_dict(m)
    m3 = _Block()
    apply_lora(m3, rank=3, alpha=2, target_modules=["to_q"])
    with pytest.raises(InvariantError, match="shape"):
        load_lora_state_dict(m3, sd)
