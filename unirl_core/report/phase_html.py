"""Light HTML pages for each phase (Flyte decks and the local run report): tables and inline SVG, no JS.

Every function returns a self-contained HTML fragment. The same fragment is shown as a task's deck and
written into the run directory, so a local run and a cluster run show the same page.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

from unirl_core.report.preview import batch_preview_html
from unirl_core.types import SampleBatch

_TABLE = "<table border='1' cellspacing='0' cellpadding='3' style='font-family:sans-serif;font-size:12px'>"


def _num(x: object) -> str:
    if isinstance(x, float):
        return f"{x:.5g}"
    return html.escape(str(x))


def metrics_table(metrics: Mapping[str, object], title: str = "metrics") -> str:
    """Two-column table of ``name -> value``, sorted by name."""
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{_num(v)}</td></tr>" for k, v in sorted(metrics.items()))
    return f"<h4>{html.escape(title)}</h4>{_TABLE}<tr><th>name</th><th>value</th></tr>{rows}</table>"


def _stats(xs: Sequence[float]) -> dict[str, float]:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / n
    return {"n": n, "mean": mean, "std": math.sqrt(var), "min": min(xs), "max": max(xs)}


def histogram_svg(values: Sequence[float], *, bins: int = 12, width: int = 240, height: int = 80) -> str:
    """A bar histogram as inline SVG (a few hundred bytes)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "<svg width='0' height='0'></svg>"
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    counts = [0] * bins
    for v in finite:
        counts[min(int((v - lo) / span * bins), bins - 1)] += 1
    top = max(counts)
    bw = width / bins
    bars = "".join(
        f"<rect x='{i * bw:.1f}' y='{height - 14 - c / top * (height - 18):.1f}' width='{bw - 1:.1f}' "
        f"height='{c / top * (height - 18):.1f}' fill='#4a78c2'/>" for i, c in enumerate(counts) if c)
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}'>{bars}"
            f"<text x='0' y='{height - 2}' font-size='10'>{lo:.3g}</text>"
            f"<text x='{width}' y='{height - 2}' font-size='10' text-anchor='end'>{hi:.3g}</text></svg>")


def rollout_html(batch: SampleBatch, metrics: Mapping[str, float]) -> str:
    """Rollout deck: the sample grid (image thumbnails or a text table) and the engine's timings."""
    return batch_preview_html(batch, title="rollout") + metrics_table(metrics, "rollout metrics")


def reward_html(batch: SampleBatch, metrics: Mapping[str, float]) -> str:
    """Reward deck: per-component distribution (stats + histogram) and the weighted total."""
    comps: dict[str, list[float]] = {}
    for p in batch.generated:
        for k, v in p.rewards.items():
            comps.setdefault(k, []).append(v)
        if p.reward is not None:
            comps.setdefault("total", []).append(p.reward)
    rows = []
    for name, xs in comps.items():
        s = _stats(xs)
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{s['n']}</td><td>{s['mean']:.4g}</td>"
                    f"<td>{s['std']:.4g}</td><td>{s['min']:.4g}</td><td>{s['max']:.4g}</td>"
                    f"<td>{histogram_svg(xs)}</td></tr>")
    invalid = sum(not p.valid for p in batch.generated)
    return (f"<h3>reward: {len(batch)} samples, {invalid} invalid</h3>{_TABLE}<tr><th>component</th><th>n</th>"
            "<th>mean</th><th>std</th><th>min</th><th>max</th><th>distribution</th></tr>" + "".join(rows)
            + "</table>" + metrics_table(metrics, "reward metrics"))


def advantage_html(batch: SampleBatch, metrics: Mapping[str, float]) -> str:
    """Advantage deck: one row per group (size, reward mean/std, advantage range, kept samples)."""
    rows = []
    for gid, idx in batch.groups().items():
        parts = [batch.samples[i].generated for i in idx]
        rew = [p.reward for p in parts if p.reward is not None]
        adv = [p.advantage for p in parts if p.advantage is not None]
        cells = [str(len(idx))]
        if rew:
            rs = _stats(rew)
            cells += [f"{rs['mean']:.4g}", f"{rs['std']:.4g}"]
        else:
            cells += ["", ""]
        cells += [f"{min(adv):.4g}", f"{max(adv):.4g}"] if adv else ["", ""]
        cells.append(str(len(adv)))
        rows.append(f"<tr><td>{html.escape(gid)}</td>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f"<h3>advantage: {len(batch.groups())} groups</h3>{_TABLE}<tr><th>group</th><th>samples</th>"
            "<th>reward mean</th><th>reward std</th><th>adv min</th><th>adv max</th><th>with advantage</th></tr>"
            + "".join(rows) + "</table>" + metrics_table(metrics, "advantage metrics"))


def train_html(metrics: Mapping[str, float]) -> str:
    """Train deck: loss, ratio, KL, clip fraction, grad norm and timings (whatever the backend reports)."""
    return "<h3>train</h3>" + metrics_table(metrics, "train metrics")


def publish_html(info: Mapping[str, object]) -> str:
    """Publish deck: version, and each file with its size and sha256."""
    files = info.get("files") or {}
    rows = ""
    if isinstance(files, Mapping):
        for name, meta in sorted(files.items()):
            meta = meta if isinstance(meta, Mapping) else {"value": meta}
            rows += (f"<tr><td>{html.escape(str(name))}</td><td>{_num(meta.get('bytes', ''))}</td>"
                     f"<td><code>{html.escape(str(meta.get('sha256', '')))}</code></td></tr>")
    scalars = {k: v for k, v in info.items() if k != "files" and not isinstance(v, (Mapping, list))}
    return (metrics_table(scalars, "published version")
            + (f"{_TABLE}<tr><th>file</th><th>bytes</th><th>sha256</th></tr>{rows}</table>" if rows else ""))
