"""Light HTML pages for each phase (Flyte decks and the local run report): tables and inline SVG, no JS.

Every function returns a self-contained HTML fragment. The same fragment is shown as a task's deck and
written into the run directory, so a local run and a cluster run show the same page.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

from unirl_core.report import charts
from unirl_core.report.conversation import conversations_html
from unirl_core.report.preview import batch_preview_html
from unirl_core.types import SampleBatch

_TABLE = "<table border='1' cellspacing='0' cellpadding='3' style='font-family:sans-serif;font-size:12px'>"


def _num(x: object) -> str:
    if isinstance(x, float):
        return f"{x:.5g}"
    return html.escape(str(x))


def metrics_table(metrics: Mapping[str, object], title: str = "metrics", css_class: str = "metrics") -> str:
    """Two-column table of ``name -> value``, sorted by name (``class`` = ``css_class``)."""
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{_num(v)}</td></tr>" for k, v in sorted(metrics.items()))
    return (f"<h4>{html.escape(title)}</h4>{_TABLE.replace('<table ', f'<table class={css_class!r} ')}"
            f"<tr><th>name</th><th>value</th></tr>{rows}</table>")


POLICY_STAT_WORDS = ("ratio", "clip", "kl", "logp_absdiff", "entropy")
"""Train metrics shown under "policy statistics" (the rest: loss, grad norm, lr, counts)."""


def _is_timing(k: str) -> bool:
    return k.startswith("time/") or "/time_" in k or k.endswith("/seconds") or "tokens_per_s" in k


def _stats(xs: Sequence[float]) -> dict[str, float]:
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / n
    return {"n": n, "mean": mean, "std": math.sqrt(var), "min": min(xs), "max": max(xs)}


def _split_timings(metrics: Mapping[str, float], title: str) -> str:
    timings = {k: v for k, v in metrics.items() if _is_timing(k)}
    rest = {k: v for k, v in metrics.items() if k not in timings}
    return (metrics_table(rest, title) if rest else "") + (metrics_table(timings, "timings (s)", "timings")
                                                           if timings else "")


def rollout_html(batch: SampleBatch, metrics: Mapping[str, float]) -> str:
    """Rollout deck: the sample grid (image thumbnails or a text table), agentic conversations turn by turn, and
    the engine's timings."""
    return (batch_preview_html(batch, title="rollout") + conversations_html(batch)
            + _split_timings(metrics, "rollout metrics"))


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
                    f"<td class='distribution'>{charts.histogram_svg(xs)}</td></tr>")
    invalid = sum(not p.valid for p in batch.generated)
    return (f"<h3>reward: {len(batch)} samples, {invalid} invalid</h3>"
            f"{_TABLE.replace('<table ', '<table class=reward-components ')}<tr><th>component</th><th>n</th>"
            "<th>mean</th><th>std</th><th>min</th><th>max</th><th>distribution</th></tr>" + "".join(rows)
            + "</table>" + _split_timings(metrics, "reward metrics"))


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
            + "".join(rows) + "</table>" + _split_timings(metrics, "advantage metrics"))


def train_html(metrics: Mapping[str, float]) -> str:
    """Train deck: policy statistics (ratio, clip fraction, KL, logp drift, entropy), the other train metrics
    (loss, grad norm, lr) and timings, as three tables (whatever the backend reports)."""
    stats = {k: v for k, v in metrics.items()
             if not _is_timing(k) and any(w in k.rsplit("/", 1)[-1] for w in POLICY_STAT_WORDS)}
    rest = {k: v for k, v in metrics.items() if k not in stats}
    return ("<h3>train</h3>" + (metrics_table(stats, "policy statistics (ratio, clip, KL, logp drift)",
                                              "policy-stats") if stats else "")
            + _split_timings(rest, "train metrics"))


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
