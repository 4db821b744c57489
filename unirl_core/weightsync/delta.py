"""Deltas on the wire: a version sent as the elements that changed since the version the receivers hold.

The sender keeps the last version it sent (``SentBase``: the tensors in their wire dtypes, on its sync device).
Per tensor it compares the new bit patterns with the base's (viewed as integers of the dtype's width: lossless,
NaN payloads and signed zeros included) and picks the smallest of three exact encodings for ``n`` elements of
``e`` bytes with ``k`` changed:

- ``idx``: the changed positions (int32) and their new bit patterns, ``k * (4 + e)`` bytes;
- ``mask``: a bitmap of the changed positions (one bit per element) and their new bit patterns, ``n / 8 + k * e``;
- ``dense``: the tensor itself, ``n * e``.

``idx`` wins below ``k / n = 1 / 32`` (3.1 %), which covers bf16 training's usual 1-3 % of changed elements; the
bitmap from there until nearly every element changed. New values rather than XOR patterns: a receiver whose tied
weights are two names of one tensor applies both names' pieces and stays right (an XOR would cancel itself).
Everything is torch ops on the device (no compression: no zstd on a GPU).

A digest per tensor (``tensor_digest``: a plain and two position-weighted sums of its bytes read as 32-bit words,
coprime position moduli, exact integer arithmetic without overflow; a checksum against accidents, not an adversary) travels in the header; receivers recompute it on what they hold after a sync and
keep the version's digest, which is what a later delta's header names as its base.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from unirl_core.errors import field_error
from unirl_core.weightsync.wire import TensorSpec, WeightSyncError

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST_MODULI = (65521, 65519)  # position weights p mod 65521 + 1 and p mod 65519 + 1: coprime, so the pair
# repeats only every 65521 * 65519 (~2^32) words, more than any tensor holds (int32 positions)
_DIGEST_CHUNK = 1 << 22  # elements per reduction (bounded int64 scratch): each term < 2^32, so a chunk's sum < 2^54
_DIGEST_MOD = (1 << 61) - 1
_INDEX_LIMIT = 1 << 31  # int32 positions
MODES = ("idx", "mask", "dense")


def bits(t: Tensor) -> Tensor:
    """``t`` flat, as integers of its element width (a view when ``t`` is contiguous)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INT_VIEW[flat.element_size()])


def tensor_digest(t: Tensor) -> list[int]:
    """[sum of the 32-bit words, two position-weighted sums] mod 2^61 - 1 over ``t``'s bytes. Word p weighs
    ``p mod 65521 + 1`` in one sum and ``p mod 65519 + 1`` in the other (coprime moduli: no two positions of a tensor
    weigh the same in both), so any single changed element, any two swapped words and any +d / -d pair change it.
    Exact: each word is split into 16-bit halves, so every product is below 2^32 and an int64 chunk sum cannot
    overflow; the chunks are added in Python. On ``t``'s device, in chunks (bounded scratch memory). Narrow dtypes
    are read as 32-bit words when their bytes allow (half the passes' elements for bf16); a view whose storage
    offset is not word-aligned is copied first. A checksum against accidents, not an adversary."""
    if t.dim() and t.is_contiguous() and (t.storage_offset() * t.element_size()) % 4:
        t = t.clone()
    b = bits(t)
    if b.element_size() == 8 or (b.element_size() < 4 and b.numel() * b.element_size() % 4 == 0):
        b = b.view(torch.int32)
    n = b.numel()
    if n == 0:
        return [0, 0, 0]
    size = min(n, _DIGEST_CHUNK)
    x = torch.empty(size, dtype=torch.int64, device=b.device)  # scratch, reused: no page faults per chunk
    half, w = torch.empty_like(x), torch.empty_like(x)
    base = torch.arange(size, dtype=torch.int64, device=b.device)
    sums = []
    for lo in range(0, n, _DIGEST_CHUNK):
        m = min(_DIGEST_CHUNK, n - lo)
        xs, hs, ws = x[:m], half[:m], w[:m]
        xs.copy_(b[lo:lo + m])
        row = [xs.sum()]
        for mod in _DIGEST_MODULI:
            torch.add(base[:m], lo, out=ws).remainder_(mod).add_(1)
            row.append(torch.bitwise_and(xs, 0xFFFF, out=hs).mul_(ws).sum())   # low halves, 0..65535
            row.append(torch.bitwise_right_shift(xs, 16, out=hs).mul_(ws).sum())  # high halves, signed
        sums.append(torch.stack(row))
    rows = torch.stack(sums).tolist()  # one device sync per tensor
    total = [sum(r[i] for r in rows) for i in range(5)]  # exact: Python ints
    plain, lo1, hi1, lo2, hi2 = total
    return [plain % _DIGEST_MOD, (hi1 * 65536 + lo1) % _DIGEST_MOD, (hi2 * 65536 + lo2) % _DIGEST_MOD]


def version_digest(names: list[str], digests: list[list[int]]) -> str:
    """The digest of a whole version: what a delta's header names as its base."""
    return hashlib.sha256(json.dumps([names, digests], separators=(",", ":")).encode()).hexdigest()[:32]


def choose_mode(n: int, k: int, itemsize: int) -> str:
    """The exact encoding with the fewest bytes for ``k`` of ``n`` elements changed (ties: the first of MODES)."""
    costs = {"idx": k * (4 + itemsize) if n < _INDEX_LIMIT else None, "mask": (n + 7) // 8 + k * itemsize,
             "dense": n * itemsize}
    best = min(c for c in costs.values() if c is not None)
    return next(m for m in MODES if costs[m] == best)


def pack_mask(mask: Tensor) -> Tensor:
    """bool ``[n]`` -> uint8 ``[ceil(n / 8)]``, bit j of byte i = element 8 i + j."""
    pad = (-mask.numel()) % 8
    m = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (m.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def unpack_mask(packed: Tensor, n: int) -> Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return packed.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1)[:n].bool()


def piece_specs(spec: TensorSpec, mode: str, k: int) -> list[TensorSpec]:
    """The wire tensors of one tensor's delta, in order (``plan_buckets`` packs them like weights)."""
    if mode == "dense":
        return [TensorSpec(f"{spec.name}#dense", (spec.numel,), spec.dtype)]
    where = TensorSpec(f"{spec.name}#idx", (k,), "int32") if mode == "idx" else \
        TensorSpec(f"{spec.name}#mask", ((spec.numel + 7) // 8,), "uint8")
    return [where, TensorSpec(f"{spec.name}#val", (k,), spec.dtype)]


def encode(new: Tensor, old: Tensor) -> tuple[str, int, list[Tensor]]:
    """(mode, changed count, the pieces of ``piece_specs``) of ``new`` against ``old`` (same shape and dtype)."""
    nb, ob = bits(new), bits(old)
    changed = nb != ob
    k = int(changed.sum())
    mode = choose_mode(nb.numel(), k, nb.element_size())
    if mode == "dense":
        return mode, k, [new.detach().reshape(-1)]
    if mode == "idx":
        pos = changed.nonzero().view(-1)
        return mode, k, [pos.to(torch.int32), nb.index_select(0, pos).view(new.dtype)]
    return mode, k, [pack_mask(changed), nb[changed].view(new.dtype)]


def apply(name: str, target: Tensor, mode: str, k: int, pieces: list[Tensor]) -> None:
    """Write one tensor's delta into ``target`` in place; ``WeightSyncError`` naming it when the pieces do not fit."""
    flat = target.detach().view(-1) if target.is_contiguous() else target.detach().reshape(-1).clone()
    tb = bits(flat)
    try:
        if mode == "dense":
            tb.copy_(bits(pieces[0]))
        elif mode == "idx":
            tb.index_copy_(0, pieces[0].long(), bits(pieces[1]))
        else:
            mask = unpack_mask(pieces[0], tb.numel())
            if int(mask.sum()) != k:
                raise ValueError(f"the bitmap marks {int(mask.sum())} elements, the header {k}")
            tb.masked_scatter_(mask, bits(pieces[1]))
    except (RuntimeError, IndexError, ValueError) as e:
        raise field_error(WeightSyncError, f"weight_sync.delta[{name!r}]", mode, "pieces that fit the tensor",
                          f"the delta is damaged ({e}); the engine holds no version, the next publish is full") from e
    if flat.data_ptr() != target.data_ptr() or not target.is_contiguous():
        target.detach().copy_(flat.view(target.shape))


@dataclass(eq=False)
class SentBase:
    """The sender's copy of the last version it sent (wire dtypes, on its sync device), to encode the next one
    against. ``held``: (version, version digest) the buffers hold, None while they hold no complete version."""

    device: torch.device
    tensors: dict[str, Tensor] = field(default_factory=dict)
    held: tuple[int, str] | None = None
    digests: dict[str, list[int]] = field(default_factory=dict)
    """Each buffer's digest: a tensor with no changed element keeps it (a frozen or slow tensor costs no pass)."""

    def update(self, names: list[str], specs: list[TensorSpec],
               fetch: Callable[[int], Tensor]) -> tuple[list[list] | None, list[Tensor], list[list[int]]]:
        """Take the new version (``fetch(i)``: tensor ``i`` whole, in its wire dtype, called once each in order):
        encode each tensor against the base when the base has every name with the same shape and dtype, then keep
        it as the base. Returns (``[[mode, k], ...]`` or None when no delta fits, the pieces in wire order, the
        per-tensor digests)."""
        usable = self.held is not None and set(self.tensors) == set(names) and all(
            tuple(self.tensors[n].shape) == s.shape and str(self.tensors[n].dtype).removeprefix("torch.") == s.dtype
            for n, s in zip(names, specs))
        self.held = None  # from the first copy on the buffers hold no complete version
        if not usable:
            self.tensors, self.digests = {}, {}
        modes: list[list] | None = [] if usable else None
        pieces: list[Tensor] = []
        digests = []
        with torch.no_grad():
            for i, name in enumerate(names):
                new = fetch(i).to(self.device).reshape(specs[i].shape)
                if modes is not None:
                    mode, k, got = encode(new, self.tensors[name])
                    if mode == "dense":  # the base buffer is about to hold exactly these values (other pieces
                        got = [self.tensors[name].view(-1)]  # are fresh tensors, untouched by the copy below)
                    modes.append([mode, k])
                    pieces.extend(got)
                    if k:
                        self.tensors[name].copy_(new)
                        self.digests.pop(name, None)
                else:
                    self.tensors[name] = new.clone(memory_format=torch.contiguous_format)
                if name not in self.digests:
                    self.digests[name] = tensor_digest(self.tensors[name])
                digests.append(self.digests[name])
        return modes, pieces, digests
