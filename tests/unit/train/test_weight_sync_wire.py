"""Pure pieces of the weight-sync protocol: bucket plan, header round trip, spec checks, config."""

import itertools

import pytest
import torch
from torch import nn

from unirl_core.errors import ConfigError
from unirl_core.models.lora import apply_lora
from unirl_core.weightsync.sync import (
    PROTOCOL,
    TensorSpec,
    WeightSyncConfig,
    WeightSyncError,
    check_specs,
    decode_header,
    encode_header,
    gather_for_sync,
    plan_buckets,
    spec_of,
    specs_of_header,
    sync_names,
    weights_header,
)


def S(name, shape, dtype="float32"):
    return TensorSpec(name, tuple(shape), dtype)


def test_buckets_group_per_dtype_in_first_seen_order_and_respect_capacity():
    specs = [S("a", (4,)), S("h", (2,), "bfloat16"), S("b", (3,)), S("c", (2,)), S("i", (5,), "bfloat16")]
    # 32 bytes = 8 fp32 elements or 16 bf16 elements
    plan = plan_buckets(specs, 32)
    assert [(b.dtype, b.numel, b.entries) for b in plan] == [
        ("float32", 7, ((0, 0, 4), (2, 4, 3))),      # a + b fill 7 of 8; c would overflow
        ("float32", 2, ((3, 0, 2),)),
        ("bfloat16", 7, ((1, 0, 2), (4, 2, 5))),
    ]


def test_exact_fit_stays_in_one_bucket_and_one_more_element_starts_the_next():
    assert len(plan_buckets([S("a", (4,)), S("b", (4,))], 32)) == 1
    plan = plan_buckets([S("a", (4,)), S("b", (5,))], 32)
    assert [b.entries for b in plan] == [((0, 0, 4),), ((1, 0, 5),)]


def test_tensor_larger_than_a_bucket_travels_alone_at_its_own_size():
    plan = plan_buckets([S("small", (2,)), S("big", (10, 3)), S("tail", (1,))], 16)
    assert [(b.numel, b.entries) for b in plan] == [(2, ((0, 0, 2),)), (30, ((1, 0, 30),)), (1, ((2, 0, 1),))]


def test_tensors_of_at_least_direct_bytes_travel_alone_and_small_ones_still_pack():
    specs = [S("a", (2,)), S("big", (4,)), S("b", (1,)), S("huge", (3, 3))]
    plan = plan_buckets(specs, 1024, direct_bytes=16)  # 16 bytes = 4 fp32 elements
    assert [b.entries for b in plan] == [((1, 0, 4),), ((3, 0, 9),), ((0, 0, 2), (2, 2, 1))]
    plan = plan_buckets(specs, 1024, direct_bytes=17)
    assert [b.entries for b in plan] == [((3, 0, 9),), ((0, 0, 2), (1, 2, 4), (2, 6, 1))]


def test_zero_size_tensors_and_empty_plan():
    assert plan_buckets([], 8) == []
    plan = plan_buckets([S("e", (0, 4)), S("a", (2,))], 8)
    assert [(b.numel, b.entries) for b in plan] == [(2, ((0, 0, 0), (1, 0, 2)))]


def test_every_element_is_covered_exactly_once():
    specs = [S(f"t{i}", (i % 5 + 1, 3), ("float32", "float16")[i % 2]) for i in range(23)]
    for cap in (1, 7, 64, 10_000):
        seen = {}
        for b in plan_buckets(specs, cap):
            offsets = sorted((off, n) for _, off, n in b.entries)
            assert sum(n for _, n in offsets) == b.numel
            assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in itertools.pairwise(offsets))
            for i, _, n in b.entries:
                assert specs[i].dtype == b.dtype
                seen[i] = seen.get(i, 0) + n
        assert seen == {i: s.numel for i, s in enumerate(specs)}


def test_header_round_trip_and_foreign_payloads():
    specs = [spec_of("w", torch.zeros(2, 3, dtype=torch.bfloat16)), spec_of("b", torch.zeros(3))]
    header = weights_header(specs, version=7, scope="lora", bucket_bytes=1024)
    payload = encode_header(header)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    back = decode_header(payload)
    assert back == header and back["protocol"] == PROTOCOL
    assert specs_of_header(back) == specs
    with pytest.raises(WeightSyncError, match="JSON"):
        decode_header(torch.tensor([0xFF, 0xFE], dtype=torch.uint8))
    with pytest.raises(WeightSyncError, match="protocol"):
        decode_header(encode_header({"protocol": PROTOCOL + 1}))


def test_spec_nbytes_and_unsupported_dtype():
    assert S("x", (3, 4), "bfloat16").nbytes == 24
    with pytest.raises(WeightSyncError, match="complex64"):
        spec_of("x", torch.zeros(2, dtype=torch.complex64))


def test_check_specs_names_the_offending_tensor():
    targets = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    ok = [S("a", (2, 3)), S("b", (4,), "bfloat16")]
    check_specs(ok, targets)
    with pytest.raises(WeightSyncError, match="'zz'"):
        check_specs(ok + [S("zz", (1,))], targets)
    with pytest.raises(WeightSyncError, match="'b'"):  # missing
        check_specs(ok[:1], targets)
    with pytest.raises(WeightSyncError, match=r"tensors\['a'\].shape"):
        check_specs([S("a", (3, 2)), ok[1]], targets)
    with pytest.raises(WeightSyncError, match=r"tensors\['b'\].dtype=.float32"):
        check_specs([ok[0], S("b", (4,))], targets)


def test_sync_names_full_and_lora_keys_match_gather():
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    full = sync_names(module, "full")
    assert set(full) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert full["0.weight"] is module[0].weight  # in-place targets, not copies
    with pytest.raises(WeightSyncError, match="LoRA"):
        sync_names(module, "lora")
    apply_lora(module, rank=2, alpha=2.0, target_modules=("0",))
    lora = sync_names(module, "lora")
    assert set(lora) == {"0.lora_A.weight", "0.lora_B.weight"}
    assert set(gather_for_sync(module, "lora")) == set(lora)


@pytest.mark.parametrize("kw", [{"master_port": 0}, {"num_engines": 0}, {"backend": "mpi"}, {"bucket_mb": 0}, {"direct_mb": 0},
                                {"timeout_s": -1}])
def test_config_rejects_bad_values(kw):
    with pytest.raises(ConfigError):
        WeightSyncConfig(**kw)


def test_config_world_and_bucket_bytes():
    cfg = WeightSyncConfig(num_engines=3, bucket_mb=0.5)
    assert (cfg.world_size, cfg.bucket_bytes) == (4, 512 * 1024)


def test_backend_follows_the_device():
    from unirl_core.weightsync.group import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert resolve_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ConfigError, match="nccl"):
        resolve_backend("nccl", torch.device("cpu"))
