"""Completion text from token ids: decoded once, without a dangling partial character at the end.

A byte-level BPE (GPT-2, Qwen, the tiny preset) spells a character outside ASCII as 2-4 byte tokens. A
completion cut by ``max_new_tokens`` between the bytes of one character leaves an incomplete UTF-8 sequence
that tokenizers render as U+FFFD. ``decode_completion`` decodes the whole id list once and drops an
incomplete sequence at the end (it is a cut, not model output); invalid bytes in the middle (a small model
sampling random byte tokens) stay U+FFFD in the text rewards read. Rollout engines fill ``Part.text`` with
it; the report shows the remaining U+FFFD as a marker (``unirl_core.report.text``).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

REPLACEMENT = "\ufffd"


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def complete_utf8_prefix(data: bytes) -> bytes:
    """``data`` without an incomplete multi-byte UTF-8 sequence at its end (at most 3 bytes are dropped)."""
    for back in range(1, min(3, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return data[:-back] if need > back else data
    return data


def _byte_level_bytes(tokenizer, ids: list[int]) -> bytes | None:
    """The raw bytes of ``ids`` for a byte-level BPE (special tokens skipped); None for other tokenizers."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if "ByteLevel" not in repr(decoder) and not hasattr(tokenizer, "byte_decoder"):
        return None  # SentencePiece byte fallback (<0xE2>), WordPiece, ...: their tokens are not byte symbols
    try:
        tokens = tokenizer.convert_ids_to_tokens(ids)
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    except Exception:  # noqa: BLE001 - any tokenizer without the slow-token API: fall back to decode()
        return None
    table = _byte_decoder()
    out = bytearray()
    for i, t in zip(ids, tokens):
        if i in special or t is None:
            continue
        if not all(c in table for c in t):
            return None  # a SentencePiece/WordPiece token (or an added token): not byte-level
        out.extend(table[c] for c in t)
    return bytes(out)


def decode_completion(tokenizer, ids: Iterable[int], *, skip_ids: Iterable[int] = ()) -> str:
    """Text of a whole completion: ``ids`` (minus ``skip_ids`` such as EOS) decoded at once, an incomplete
    character at the end dropped, other invalid bytes as U+FFFD (what ``tokenizer.decode`` gives them)."""
    skip = set(skip_ids)
    ids = [int(t) for t in ids if int(t) not in skip]
    raw = _byte_level_bytes(tokenizer, ids)
    if raw is not None:
        return complete_utf8_prefix(raw).decode("utf-8", errors="replace")
    # not byte-level: trailing replacement characters can only come from a cut inside a character
    return tokenizer.decode(ids, skip_special_tokens=True).rstrip(REPLACEMENT)
