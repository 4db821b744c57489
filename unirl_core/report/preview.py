"""Light HTML previews of a SampleBatch (decks, run reports): no JavaScript, small thumbnails."""

from __future__ import annotations

import base64
import hashlib
import html
import io
import threading
from collections import OrderedDict

from unirl_core.report.text import display_html
from unirl_core.types import DiffusionSegment, Part, SampleBatch, TokenSegment

THUMB_PX = 96
EMBED_MAX_BYTES = 4096
"""A PNG at most this big that already fits the thumbnail goes in as it is: flat-colour renders (the shapes world)
compress to ~1 KB, stay sharp and skip a decode; noisy ones (a random tiny model's, ~10 KB at 64 px) would make
pages 3-4x larger than their JPEG thumbnails and take the JPEG path."""
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from a PNG's header (no decode); None for anything else."""
    if len(data) < 24 or data[:8] != _PNG_MAGIC or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def thumbnail_data_uri(png: bytes, size: int = THUMB_PX) -> str:
    """A small data URI of an image (keeps a deck of 64 samples well under 1 MB): the PNG itself when it already
    fits ``size`` and is at most ``EMBED_MAX_BYTES`` (no decode, lossless), else a JPEG thumbnail (kept per process
    by content hash, see ``THUMB_CACHE_ENTRIES``)."""
    dims = png_size(png)
    if dims is not None and max(dims) <= size and len(png) <= EMBED_MAX_BYTES:
        return "data:image/png;base64," + base64.b64encode(png).decode()
    key = (hashlib.blake2b(png, digest_size=16).digest(), size)
    with _THUMBS_LOCK:
        hit = _THUMBS.get(key)
        if hit is not None:
            _THUMBS.move_to_end(key)
            return hit
    uri = _jpeg_thumbnail(png, size)
    with _THUMBS_LOCK:
        _THUMBS[key] = uri
        while len(_THUMBS) > THUMB_CACHE_ENTRIES:
            _THUMBS.popitem(last=False)
    return uri


THUMB_CACHE_ENTRIES = 512
"""JPEG thumbnails kept per process, keyed by the image's content hash and size (a few KB each): a local run's
report task shows the rollout page its rollout task rendered for its deck, in the same process, and reuses
those thumbnails instead of decoding and resizing every image again. Same bytes in, same thumbnail out."""
_THUMBS: OrderedDict[tuple[bytes, int], str] = OrderedDict()
_THUMBS_LOCK = threading.Lock()


def _jpeg_thumbnail(png: bytes, size: int) -> str:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        im = im.convert("RGB")
        im.thumbnail((size, size))
        out = io.BytesIO()
        im.save(out, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def _shapes(p: Part) -> str:
    seg = p.segment
    if isinstance(seg, DiffusionSegment):
        return f"latents {tuple(seg.latents.shape)} {str(seg.latents.dtype).removeprefix('torch.')}, " \
               f"{int(seg.sde_mask.sum())} SDE steps"
    if isinstance(seg, TokenSegment):
        return f"prompt {seg.prompt_ids.numel()} tok, response {seg.response_ids.numel()} tok ({seg.finish_reason})"
    return "not rolled out"


def batch_preview_html(batch: SampleBatch, *, max_rows: int = 64, title: str = "SampleBatch") -> str:
    """A self-contained HTML table: sample, group, prompt, output (thumbnail or text), rewards, advantage."""
    rows = []
    for s in batch.samples[:max_rows]:
        p = s.generated
        if p.media:
            out = f'<img src="{thumbnail_data_uri(p.media)}" width="{THUMB_PX}">'
        else:
            out = display_html(p.text or "", 300)
        comps = ", ".join(f"{html.escape(k)}={v:.3g}" for k, v in p.rewards.items())
        rows.append(
            f"<tr><td>{html.escape(s.sample_id)}</td><td>{html.escape(s.group_id)}</td>"
            f"<td>{html.escape(p.prompt[:200])}</td><td>{out}</td><td>{_fmt(p.reward)}"
            f"{'' if p.valid else ' <b>invalid</b>'}</td><td>{comps}</td><td>{_fmt(p.advantage)}</td>"
            f"<td>v{p.policy_version}</td><td>{html.escape(_shapes(p))}</td></tr>")
    more = len(batch) - max_rows
    meta = ", ".join(f"{html.escape(k)}={html.escape(v)}" for k, v in batch.metadata.items())
    return (f"<h3>{html.escape(title)}: {len(batch)} samples in {len(batch.groups())} groups</h3>"
            f"<p>{meta}</p>"
            f"<table class='{'sample-grid' if any(p.media for p in batch.generated) else 'conversations'}' "
            "border='1' cellspacing='0' cellpadding='3' style='font-family:sans-serif;font-size:12px'>"
            "<tr><th>sample</th><th>group</th><th>prompt</th><th>output</th><th>reward</th><th>components</th>"
            "<th>advantage</th><th>policy</th><th>shapes</th></tr>" + "".join(rows) + "</table>"
            + (f"<p>... {more} more samples</p>" if more > 0 else ""))
