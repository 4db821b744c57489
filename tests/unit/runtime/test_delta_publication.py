"""``build.load_policy_weights`` with delta versions: a module that holds a delta's base gets the delta alone,
checked against the version's digest; anything else (another base, weights written behind its back, other dtypes)
reads the version in full. Tied weights (one storage under two names) are XOR-ed once."""

from types import SimpleNamespace

import torch
from torch import nn

from unirl_core.checkpoint import CheckpointStore, load_manifest, load_weights
from unirl_core.checkpoint.delta import DeltaVersions, WeightsMemory, bits
from unirl_core.config import load_recipe
from unirl_core.runtime import build


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, dtype=torch.bfloat16)
        self.head = nn.Linear(8, 16, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.emb.weight  # tied, as an LM head often is
        self.norm = nn.LayerNorm(8, dtype=torch.bfloat16)


def _versions(tmp_path, n: int):
    """A run of ``n`` bf16 versions (1 full, then deltas) written from a trained copy of ``Tied``."""
    torch.manual_seed(0)
    trainer = Tied()
    store = CheckpointStore(str(tmp_path), "r", keep_last=100, encoding=DeltaVersions(8))
    memory, written = WeightsMemory(), {}
    for step in range(1, n + 1):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        weights = {k: v.clone() for k, v in trainer.state_dict().items()}
        written[step] = store.save(step, weights=weights, policy_version=step, memory=memory), weights
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}"])
    return cfg, written


def _holds(module: nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    state = module.state_dict()
    return all(torch.equal(bits(state[k]), bits(v)) for k, v in weights.items())


def test_a_module_at_the_base_gets_the_delta_and_the_result_is_the_version(tmp_path):
    cfg, written = _versions(tmp_path, 4)
    assert [load_manifest(ref).chain for ref, _ in written.values()] == [[], [1], [1, 2], [1, 2, 3]]
    policy = SimpleNamespace(module=Tied())
    assert build.load_policy_weights(policy, written[1][0], cfg) is False  # a full version
    for step in (2, 3, 4):
        ref, weights = written[step]
        assert build.load_policy_weights(policy, ref, cfg) is True
        assert _holds(policy.module, weights)
        assert policy.module.head.weight is policy.module.emb.weight
    assert build.held_weights(policy.module) == load_manifest(written[4][0]).delta["sha256"]


def test_a_module_not_at_the_base_reads_the_version_in_full(tmp_path):
    cfg, written = _versions(tmp_path, 4)
    policy = SimpleNamespace(module=Tied())
    build.load_policy_weights(policy, written[1][0], cfg)
    assert build.load_policy_weights(policy, written[3][0], cfg) is False  # holds 1, the delta is against 2
    assert _holds(policy.module, written[3][1])
    with torch.no_grad():
        policy.module.norm.weight.add_(1.0)  # written behind the label's back: the digest check catches it
    assert build.load_policy_weights(policy, written[4][0], cfg) is False
    assert _holds(policy.module, written[4][1])
    build.apply_policy_weights(policy, load_weights(written[2][0]), where="test")  # any other load forgets it
    assert build.held_weights(policy.module) is None
    assert build.load_policy_weights(policy, written[3][0], cfg) is False and _holds(policy.module, written[3][1])
    fp32 = SimpleNamespace(module=Tied().float())  # other dtypes than the delta's: read in full
    build.load_policy_weights(fp32, written[2][0], cfg)
    assert build.load_policy_weights(fp32, written[3][0], cfg) is False
    assert all(torch.equal(fp32.module.state_dict()[k], v.float()) for k, v in written[3][1].items())
