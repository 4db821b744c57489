"""Completion text for people: U+FFFD and non-printable characters shown as marked placeholders.

Completions reach the report already decoded whole by the rollout engines (``unirl_core.models.text``:
no dangling partial character at a cut); invalid bytes in the middle (a small model sampling random byte
tokens) stay U+FFFD in the text rewards read, and ``display_html`` shows them as a grey marker instead.
"""

from __future__ import annotations

import html
import re

from unirl_core.models.text import REPLACEMENT, complete_utf8_prefix, decode_completion

__all__ = ["BAD_UTF8_HTML", "REPLACEMENT", "complete_utf8_prefix", "decode_completion", "display_html"]

BAD_UTF8_HTML = "<span class='bad-utf8' title='bytes that are not valid UTF-8' style='color:#999'>[?]</span>"


def display_html(text: str, limit: int | None = None) -> str:
    """``text`` (cut to ``limit`` characters) HTML-escaped, each run of U+FFFD as a grey ``[?]`` marker and
    non-printable characters as grey ``\\uXXXX`` escapes."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    parts = re.split(f"{REPLACEMENT}+", text)
    return BAD_UTF8_HTML.join(_visible(p) for p in parts)


def _visible(text: str) -> str:
    """Escaped text with control and other non-printable characters (which fonts draw as empty boxes) spelled
    as grey ``\\uXXXX`` escapes; newlines and tabs stay."""
    return "".join(html.escape(c) if c.isprintable() or c in "\n\t" else
                   f"<span class='nonprint' style='color:#999'>\\u{ord(c):04x}</span>" for c in text)
