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


def _is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return "ByteLevel" in repr(decoder) or hasattr(tokenizer, "byte_decoder")


def _byte_level_bytes(tokenizer, ids: list[int], special: set[int]) -> bytes | None:
    """The raw bytes of ``ids`` for a byte-level BPE (``special`` ids skipped); None when a token is no byte
    symbol string (SentencePiece byte fallback ``<0xE2>``, WordPiece, an added token)."""
    try:
        tokens = tokenizer.convert_ids_to_tokens(ids)
    except Exception:  # noqa: BLE001 - any tokenizer without the slow-token API: fall back to decode()
        return None
    table = _byte_decoder()
    out = bytearray()
    for i, t in zip(ids, tokens):
        if i in special or t is None:
            continue
        if not all(c in table for c in t):
            return None
        out.extend(table[c] for c in t)
    return bytes(out)


def decode_completions(tokenizer, completions: Iterable[Iterable[int]], *, skip_ids: Iterable[int] = ()) -> list[str]:
    """``decode_completion`` of each id list; the tokenizer is inspected once for the whole batch."""
    skip = set(skip_ids)
    byte_level = _is_byte_level(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ()) if byte_level else set()
    out = []
    for ids in completions:
        ids = [int(t) for t in ids if int(t) not in skip]
        raw = _byte_level_bytes(tokenizer, ids, special) if byte_level else None
        if raw is not None:
            out.append(complete_utf8_prefix(raw).decode("utf-8", errors="replace"))
        else:  # not byte-level: trailing replacement characters can only come from a cut inside a character
            out.append(tokenizer.decode(ids, skip_special_tokens=True).rstrip(REPLACEMENT))
    return out


def decode_completion(tokenizer, ids: Iterable[int], *, skip_ids: Iterable[int] = ()) -> str:
    """Text of a whole completion: ``ids`` (minus ``skip_ids`` such as EOS) decoded at once, an incomplete
    character at the end dropped, other invalid bytes as U+FFFD (what ``tokenizer.decode`` gives them)."""
    return decode_completions(tokenizer, [ids], skip_ids=skip_ids)[0]
