"""Deltas on the wire, the pure pieces: which encoding a change count picks, encode -> apply round trips bit for
bit (NaN payloads, signed zeros, tied weights), the digest, damaged pieces naming the tensor."""

import pytest
import torch

from unirl_core.weightsync.delta import (
    SentBase,
    apply,
    bits,
    choose_mode,
    encode,
    pack_mask,
    piece_specs,
    tensor_digest,
    unpack_mask,
)
from unirl_core.weightsync.wire import TensorSpec, WeightSyncError


def setup_module():
    torch.set_num_threads(1)


def test_the_cheapest_exact_encoding_is_picked_by_changed_fraction():
    n = 32 * 1000  # bf16: idx costs 6 bytes per change, the bitmap n / 8 + 2 per change, dense 2 n
    assert choose_mode(n, 0, 2) == "idx"
    assert choose_mode(n, 320, 2) == "idx"          # 1 %
    assert choose_mode(n, 999, 2) == "idx"          # just below 1 / 32
    assert choose_mode(n, 1000, 2) == "idx"         # the tie (6000 bytes each) goes to positions
    assert choose_mode(n, 1001, 2) == "mask"
    assert choose_mode(n, n - n // 16, 2) == "mask"
    assert choose_mode(n, n, 2) == "dense"
    assert choose_mode(n, 999, 4) == "idx" and choose_mode(n, 1001, 4) == "mask"  # the break-even is 1/32 for fp32 too


def test_positions_never_used_past_int32():
    assert choose_mode(1 << 31, 1, 2) == "mask"


def test_mask_packs_eight_elements_per_byte_and_unpacks_exactly():
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 1000):
        m = torch.rand(n, generator=g) < 0.3
        packed = pack_mask(m)
        assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
        assert torch.equal(unpack_mask(packed, n), m)
    assert pack_mask(torch.tensor([True, False, False, True])).tolist() == [9]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.bool])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.2, 1.0])
def test_encode_then_apply_gives_the_new_bits(dtype, fraction):
    g = torch.Generator().manual_seed(1)
    old = (torch.randn(37, 29, generator=g) * 3).to(dtype)
    new = old.clone()
    changed = torch.rand(old.shape, generator=g) < fraction
    new[changed] = (torch.randn(int(changed.sum()), generator=g) * 3 + 0.5).to(dtype) if dtype != torch.bool \
        else ~old[changed]
    if dtype.is_floating_point:  # bit patterns, not values: a NaN payload and -0.0 must travel too
        bits(new)[0] = bits(torch.tensor([float("nan")], dtype=dtype))[0] ^ 1
        new.view(-1)[1] = -0.0 if old.view(-1)[1] != 0 or bits(old)[1] != 0 else 0.0
    mode, k, pieces = encode(new, old)
    assert k == int((bits(new) != bits(old)).sum())
    specs = piece_specs(TensorSpec("w", tuple(new.shape), str(dtype).removeprefix("torch.")), mode, k)
    assert [tuple(p.shape) for p in pieces] == [s.shape for s in specs]
    target = old.clone()
    apply("w", target, mode, k, [p.clone() for p in pieces])
    assert torch.equal(bits(target), bits(new))
    assert tensor_digest(target) == tensor_digest(new)


def test_a_sparse_change_costs_positions_and_values_only():
    old = torch.zeros(4096, dtype=torch.bfloat16)
    new = old.clone()
    new[[3, 100, 4000]] = 1.0
    mode, k, pieces = encode(new, old)
    assert (mode, k) == ("idx", 3)
    assert sum(p.numel() * p.element_size() for p in pieces) == 3 * (4 + 2)
    assert pieces[0].tolist() == [3, 100, 4000]


def test_applying_a_tied_weight_twice_is_harmless():
    old = torch.randn(10, 4).to(torch.bfloat16)
    new = old.clone()
    new[2, 1] += 1
    mode, k, pieces = encode(new, old)
    target = old.clone()
    apply("emb", target, mode, k, pieces)
    apply("head", target, mode, k, pieces)  # the same storage under a second name
    assert torch.equal(bits(target), bits(new))


def test_apply_into_a_non_contiguous_target():
    old = torch.randn(6, 8)
    target = old.clone().t()  # a transposed view
    new = target.clone()
    new[1, 2] = 7.0
    mode, k, pieces = encode(new, target.contiguous())
    apply("w", target, mode, k, pieces)
    assert torch.equal(target, new)


def test_digest_sees_one_flipped_bit_and_a_swap():
    t = torch.randn(1000).to(torch.bfloat16)
    d = tensor_digest(t)
    flipped = t.clone()
    bits(flipped)[500] ^= 1
    swapped = t.clone()
    swapped[[10, 20]] = t[[20, 10]]
    assert t[10] != t[20]
    assert tensor_digest(flipped) != d and tensor_digest(swapped) != d
    assert tensor_digest(t.clone()) == d


def test_damaged_pieces_raise_naming_the_tensor():
    old = torch.zeros(100)
    new = old.clone()
    new[5] = 1.0
    mode, k, pieces = encode(new, old)
    with pytest.raises(WeightSyncError, match=r"delta\['layer.w'\]"):
        apply("layer.w", old.clone(), mode, k, [torch.tensor([1000], dtype=torch.int32), pieces[1]])
    many = new.clone()
    many[:20] = 2.0
    mode, k, pieces = encode(many, old)
    assert mode == "mask"
    with pytest.raises(WeightSyncError, match=r"delta\['layer.w'\].*marks 20 elements, the header 19"):
        apply("layer.w", old.clone(), mode, k - 1, pieces)


def test_sent_base_encodes_only_once_it_holds_a_matching_version():
    base = SentBase(torch.device("cpu"))
    specs = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (2,), "bfloat16")]
    v0 = [torch.zeros(4), torch.ones(2, dtype=torch.bfloat16)]
    modes, pieces, digests = base.update(["a", "b"], specs, lambda i: v0[i])
    assert modes is None and pieces == [] and len(digests) == 2  # nothing to encode against: full
    base.held = (0, "d0")
    v1 = [torch.tensor([0.0, 1.0, 0.0, 0.0]), v0[1]]
    modes, pieces, _ = base.update(["a", "b"], specs, lambda i: v1[i])
    assert modes == [["mask", 1], ["idx", 0]]  # 4 elements: a 1-byte bitmap beats a 4-byte position
    assert torch.equal(base.tensors["a"], v1[0]) and base.held is None  # the caller labels the new version
    base.held = (1, "d1")
    other = [TensorSpec("a", (4,), "float32")]
    modes, _, _ = base.update(["a"], other, lambda i: v1[0])
    assert modes is None and list(base.tensors) == ["a"]  # other names: full again, the base rebuilt


def test_the_digest_has_no_short_period():
    """Positions weigh p mod 65521 + 1 and p mod 65519 + 1: two rows swapped 251 words apart (the period of the
    first version's weights), and a +d / -d pair that far apart, change the digest."""
    emb = torch.randn(600, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    swapped = emb.clone()
    swapped[[3, 254]] = emb[[254, 3]]
    assert not torch.equal(emb, swapped) and tensor_digest(emb) != tensor_digest(swapped)
    a = torch.zeros(70000, dtype=torch.int32)
    for j in (251, 65519, 65521):
        b = a.clone()
        b[0], b[j] = 5, -5
        assert tensor_digest(a) != tensor_digest(b), j


def test_the_digest_of_a_view_at_an_odd_offset_is_its_values_digest():
    view = torch.arange(9, dtype=torch.bfloat16)[1:]
    assert tensor_digest(view) == tensor_digest(view.clone())
