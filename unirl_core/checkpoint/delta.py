"""Version encodings: how a version's weights become payload files, and back.

``FullVersions`` writes ``model.safetensors`` every time. ``DeltaVersions`` writes a weights-only version as a
*delta*: the bitwise XOR of each tensor's bit pattern (viewed as an integer of the dtype's width) against the
same tensor of an earlier version, zstd-compressed (``model.xor.zst``: a safetensors stream of the XOR patterns, in
the tensors' own dtypes). Lossless: XOR-ing the base's bits again gives the weights back bit for bit. Between two
steps of a bf16 model trained at a small learning rate most elements keep their bits, so the XOR is mostly zero
bytes and compresses far below the full file.

A delta needs its base. The writer keeps the last version it wrote in memory (``WeightsMemory``, reused buffers)
and encodes the next against it; the manifest records the base's step and weights digest and the whole chain a
read walks (the full anchor first). A version is full when it holds the full resumable state (``train_state.pt``),
when the chain would reach ``anchor_every`` versions, when nothing fits as a base (first version, other names,
shapes or dtypes, another run, a base that is not in the store as written) - so a read never walks more than
``anchor_every - 1`` deltas.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import zstandard
from torch import Tensor

from unirl_core.checkpoint import tensorfile
from unirl_core.checkpoint.fsio import Piece, StreamHash
from unirl_core.errors import CheckpointError, ConfigError, field_error

DELTA_FILE = "model.xor.zst"
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 4 << 20  # elements XOR-ed and compressed at a time (bounded scratch memory)
ZSTD_LEVEL = 1  # on a mostly-zero XOR level 3 is ~1.3x slower for <1% fewer bytes (measured on a 120 MB delta)


def bits(t: Tensor) -> Tensor:
    """``t``'s bit patterns as integers of the same width (a view, no copy)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_INT_VIEW[t.element_size()])


@dataclass(eq=False)
class WeightsMemory:
    """The weights of the last version written through it, to encode the next version against. One per writer
    (``VersionWriter.memory``): written only by the thread that saves, in buffers reused version after version.
    ``version`` is None while a write is in flight or after it failed (the buffers are then no version)."""

    version: tuple[str, int, str, tuple[int, ...]] | None = None
    """(run URI, step, weights sha256, chain of that version) the buffers hold."""
    tensors: dict[str, Tensor] = field(default_factory=dict)

    def matches(self, weights: dict[str, Tensor]) -> bool:
        """True when ``weights`` have the held version's names and shapes (dtypes may differ: a delta of a bf16
        version against a fp32 full-state version XORs against the fp32 values rounded to bf16)."""
        held = self.tensors
        return set(held) == set(weights) and all(held[k].shape == weights[k].shape for k in weights)

    def keep(self, name: str, t: Tensor) -> None:
        """Copy ``t`` into the buffer for ``name`` (re-allocated when shape or dtype changed)."""
        buf = self.tensors.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            self.tensors[name] = buf = torch.empty_like(t, device="cpu")
        buf.copy_(t)


@dataclass(frozen=True, kw_only=True)
class Base:
    """The version a delta is taken against (its tensors: the writer's ``WeightsMemory``): step, its weights digest
    and the chain its own read needs."""

    step: int
    sha256: str
    chain: tuple[int, ...]


class EncodedWeights:
    """A version's weights as one payload file (``name``, ``pieces``: streamed once; ``record`` once they were
    written). ``keeps``: consuming the pieces leaves the version in the writer's memory."""

    def __init__(self, name: str, pieces: Iterator[Piece], finish, *, keeps: bool) -> None:
        self.name, self.pieces, self._finish, self.keeps = name, pieces, finish, keeps

    def record(self, file_sha256: str) -> tuple[str, dict[str, object] | None]:
        """(weights sha256, the manifest's ``delta`` record or None), once the file was written with ``file_sha256``."""
        return self._finish(file_sha256)


class VersionEncoding(Protocol):
    """How a version's weights are written (``checkpoint.weights_encoding``)."""

    name: str
    deltas: bool
    """Versions may be deltas: publication tries them first (engines at the base get the delta alone)."""

    def encode(self, weights: dict[str, Tensor], *, full_state: bool, memory: WeightsMemory | None,
               base: Base | None, weights_file: str) -> EncodedWeights: ...


def _full(weights: dict[str, Tensor], weights_file: str, memory: WeightsMemory | None) -> EncodedWeights:
    header, ordered = tensorfile.encode(weights, {"format": "pt"})
    names = tensorfile.file_order(weights)

    def pieces() -> Iterator[Piece]:
        yield from tensorfile.chunks(header, ordered)
        if memory is not None:  # after every piece was handed out: the writer's hash may still read them
            for name in set(memory.tensors) - set(names):
                del memory.tensors[name]
            for name, t in zip(names, ordered):
                memory.keep(name, t)

    return EncodedWeights(weights_file, pieces(), lambda sha: (sha, None), keeps=memory is not None)


class FullVersions:
    """Every version's weights in full (``model.safetensors``)."""

    name = "full"
    deltas = False

    def encode(self, weights: dict[str, Tensor], *, full_state: bool, memory: WeightsMemory | None,
               base: Base | None, weights_file: str) -> EncodedWeights:
        return _full(weights, weights_file, None)


class DeltaVersions:
    """Weights-only versions as zstd-compressed XOR deltas against the previous version; a full anchor every
    ``anchor_every`` versions and whenever the full resumable state is written."""

    name = "delta"
    deltas = True

    def __init__(self, anchor_every: int = 8, *, level: int = ZSTD_LEVEL, threads: int | None = None) -> None:
        if not (isinstance(anchor_every, int) and anchor_every >= 1):
            raise field_error(ConfigError, "checkpoint.anchor_every", anchor_every, "an integer >= 1",
                              "e.g. 8: a full version, then up to 7 deltas (1 writes every version in full)")
        self.anchor_every, self.level = anchor_every, level
        # zstd workers beside the thread that XORs (which the writer runs beside training): a quarter of the cores,
        # at most 4 (0: compress on the calling thread)
        self.threads = min(4, max(1, (os.cpu_count() or 4) // 4)) if threads is None else threads

    def encode(self, weights: dict[str, Tensor], *, full_state: bool, memory: WeightsMemory | None,
               base: Base | None, weights_file: str) -> EncodedWeights:
        if memory is None:
            return _full(weights, weights_file, None)
        usable = (base is not None and not full_state and len(base.chain) + 1 < self.anchor_every
                  and memory.matches(weights))
        if not usable:
            return _full(weights, weights_file, memory)
        return self._delta(weights, base, memory)

    def _delta(self, weights: dict[str, Tensor], base: Base, memory: WeightsMemory) -> EncodedWeights:
        header, ordered = tensorfile.encode(weights, {"format": "pt"})
        names = tensorfile.file_order(weights)
        canonical = StreamHash()  # the digest of what model.safetensors would hold
        state: dict[str, object] = {}

        def pieces() -> Iterator[Piece]:
            compressor = zstandard.ZstdCompressor(level=self.level, threads=self.threads).compressobj()
            scratch: dict[torch.dtype, Tensor] = {}  # one XOR buffer per width, reused (zstd copies its input)
            canonical.feed(memoryview(header))
            yield compressor.compress(header)
            for name, t in zip(names, ordered):
                old = memory.tensors[name]
                new_bits, flat_old = bits(t.reshape(-1)), old.reshape(-1)
                for view in tensorfile.chunks(b"", [t]):
                    if len(view):
                        canonical.feed(view)
                if new_bits.dtype not in scratch:
                    scratch[new_bits.dtype] = torch.empty(_CHUNK, dtype=new_bits.dtype)
                for lo in range(0, new_bits.numel(), _CHUNK):
                    hi = min(lo + _CHUNK, new_bits.numel())
                    prev = flat_old[lo:hi]
                    if prev.dtype != t.dtype:
                        prev = prev.to(t.dtype)
                    xor = torch.bitwise_xor(new_bits[lo:hi], bits(prev), out=scratch[new_bits.dtype][:hi - lo])
                    out = compressor.compress(tensorfile.as_bytes(xor))
                    if out:
                        yield out
                memory.keep(name, t)
            yield compressor.flush()
            state["size"] = canonical.size

        def finish(file_sha: str) -> tuple[str, dict[str, object]]:
            sha = canonical.hexdigest()
            return sha, {"file": DELTA_FILE, "base": base.step, "base_sha256": base.sha256,
                         "chain": [*base.chain, base.step], "sha256": sha, "bytes": int(state["size"])}

        return EncodedWeights(DELTA_FILE, pieces(), finish, keeps=True)


ENCODINGS: dict[str, type] = {"full": FullVersions, "delta": DeltaVersions}


def version_encoding(name: Literal["full", "delta"], *, anchor_every: int = 8) -> VersionEncoding:
    """The registered encoding ``name`` (``checkpoint.weights_encoding``)."""
    if name == "full":
        return FullVersions()
    if name == "delta":
        return DeltaVersions(anchor_every)
    raise field_error(ConfigError, "checkpoint.weights_encoding", name, f"one of {sorted(ENCODINGS)}",
                      "use 'full' (every version in full) or 'delta'")


def decode_delta(blob: bytearray | bytes, size: int, where: str) -> dict[str, Tensor]:
    """The XOR patterns of a delta version's file (``blob``, verified), decompressed into one buffer of ``size``
    bytes, as tensors of the version's dtypes. Raises CheckpointError naming ``where`` when it does not decode."""
    buf = bytearray(size)
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)) as reader:
            got, view = 0, memoryview(buf)
            while got < size:
                n = reader.readinto(view[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
        if got != size or extra:
            raise ValueError(f"decompressed to {'more than ' if extra else ''}{got} bytes, the manifest says {size}")
    except (zstandard.ZstdError, ValueError) as e:
        raise field_error(CheckpointError, where, f"{type(e).__name__}: {e}", "a zstd stream of the delta",
                          "the delta is damaged; restore it or read another version") from e
    return tensorfile.decode(buf, where)


def apply_delta(blob: bytearray | bytes, size: int, base: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """The weights of a delta version: its file's XOR patterns (``decode_delta``) XOR-ed with ``base`` (the base
    version's tensors, cast to each delta tensor's dtype: the rounding the writer XOR-ed against). Raises
    CheckpointError naming ``where`` when the file does not decode or does not fit ``base``."""
    xors = decode_delta(blob, size, where)
    if set(xors) != set(base) or any(xors[k].shape != base[k].shape for k in xors):
        raise field_error(CheckpointError, where, sorted(set(xors) ^ set(base))[:5] or "other shapes",
                          "the base version's tensor names and shapes", "the chain is inconsistent; read another version")
    for name, x in xors.items():
        b = base[name]
        if b.dtype != x.dtype:
            b = b.to(x.dtype)
        bits(x).bitwise_xor_(bits(b))
    return xors


def weights_digest(weights: dict[str, Tensor]) -> str:
    """sha256 of ``weights`` as the store's safetensors encoding (a full version's ``model.safetensors``); device
    tensors are copied to the host."""
    header, ordered = tensorfile.encode({k: v.detach() for k, v in weights.items()}, {"format": "pt"})
    h = hashlib.sha256()
    for piece in tensorfile.chunks(header, ordered):
        h.update(piece)
    return h.hexdigest()
