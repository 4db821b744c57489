"""The compose run report: ``<checkpoint.root>/<name>/report/``: per step the original prompt, the enhanced prompt,
the image, both Parts' rewards and advantages; an index with reward curves and every step's metrics.

Files: ``step-XXXXXXXX.html`` (one per step), ``metrics.jsonl`` (one line per step, rewritten for a re-run step),
``index.html`` (rebuilt from ``metrics.jsonl`` on every write). Written through fsspec (local or ``s3://``).
"""

from __future__ import annotations

import html
import json
import math
import posixpath

import fsspec

from unirl_core.compose.config import ComposeRunConfig
from unirl_core.report.charts import line_chart_svg
from unirl_core.report.preview import thumbnail_data_uri
from unirl_core.types import SampleBatch

CURVES = ("reward/mean", "eval/reward/mean", "eval/copy_reward/mean", "eval/exact_copy_fraction", "enhancer/reward/mean", "enhancer/train/loss", "image/train/loss",
          "enhancer/train/ratio_mean", "image/train/ratio_mean", "rollout/enhancer_tokens_mean")
MAX_ROWS = 64


def _f(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def samples_html(batch: SampleBatch, *, max_rows: int = MAX_ROWS) -> str:
    """A table: sample id, original prompt, enhanced prompt (Part 0), image (Part 1), rewards, advantages."""
    rows = []
    for s in batch.samples[:max_rows]:
        ar, img = s.parts[0], s.parts[-1]
        pic = f'<img src="{thumbnail_data_uri(img.media)}" width="64">' if img.media else ""
        comps = ", ".join(f"{html.escape(k)}={v:.3g}" for k, v in img.rewards.items() if v or k == "shapes_compositional")
        rows.append(f"<tr><td>{html.escape(s.sample_id)}</td><td>{html.escape(img.prompt)}</td>"
                    f"<td>{html.escape(ar.text or '')}</td><td>{pic}</td><td>{_f(img.reward)}</td>"
                    f"<td>{_f(img.advantage)}</td><td>{_f(ar.reward)}</td><td>{_f(ar.advantage)}</td>"
                    f"<td>{comps}</td><td>v{ar.policy_version} / v{img.policy_version}</td></tr>")
    head = ("<tr><th>sample</th><th>prompt</th><th>enhanced prompt</th><th>image</th><th>image reward</th>"
            "<th>image adv.</th><th>enhancement reward (mean)</th><th>enhancement adv.</th><th>components</th>"
            "<th>versions (enhancer / image)</th></tr>")
    more = f"<p>{len(batch) - max_rows} more samples not shown</p>" if len(batch) > max_rows else ""
    return f"<table border=1 cellspacing=0 cellpadding=3>{head}{''.join(rows)}</table>{more}"


def _eval_html(enhancements: dict[str, str] | None) -> str:
    if not enhancements:
        return ""
    rows = "".join(f"<tr><td>{html.escape(p)}</td><td>{html.escape(t)}</td></tr>" for p, t in enhancements.items())
    return f"<h3>evaluation: greedy enhancement per prompt</h3><table border=1 cellspacing=0 cellpadding=3>{rows}</table>"


def write_step_report(cfg: ComposeRunConfig, step: int, batch: SampleBatch | None, metrics: dict[str, float],
                      enhancements: dict[str, str] | None = None) -> str:
    """Write step ``step``'s page (its samples; ``enhancements``: the evaluation's greedy rewrites), record its
    metrics and rebuild the index; returns the index URI. ``batch`` None (step 0's evaluation): no sample table."""
    root = posixpath.join(cfg.run_root, "report")
    fs, path = fsspec.core.url_to_fs(root, **cfg.checkpoint.storage_options)
    fs.makedirs(path, exist_ok=True)
    page = (f"<html><head><meta charset='utf-8'><title>{html.escape(cfg.name)} step {step}</title></head><body>"
            f"<h2>{html.escape(cfg.name)}: step {step}</h2><p><a href='index.html'>index</a></p>"
            f"{samples_html(batch) if batch is not None else ''}{_eval_html(enhancements)}</body></html>")
    fs.pipe_file(posixpath.join(path, f"step-{step:08d}.html"), page.encode())
    lines_path = posixpath.join(path, "metrics.jsonl")
    history = [json.loads(x) for x in fs.cat_file(lines_path).decode().splitlines()] if fs.exists(lines_path) else []
    history = [h for h in history if int(h.get("step", -1)) != step] + [{**metrics, "step": int(step)}]
    history.sort(key=lambda h: h["step"])
    fs.pipe_file(lines_path, "".join(json.dumps(h, sort_keys=True) + "\n" for h in history).encode())
    fs.pipe_file(posixpath.join(path, "index.html"), _index(cfg, history).encode())
    return posixpath.join(root, "index.html")


def _index(cfg: ComposeRunConfig, history: list[dict]) -> str:
    charts = []
    for key in CURVES:
        pts = [(h["step"], h[key]) for h in history if isinstance(h.get(key), (int, float))]
        if pts:
            charts.append(line_chart_svg(pts, title=key))
    steps = "".join(f"<li><a href='step-{int(h['step']):08d}.html'>step {h['step']}</a>: reward "
                    f"{_f(h.get('reward/mean'))}</li>" for h in history)
    keys = sorted({k for h in history for k in h if k != "step"})
    table = "".join("<tr><td>" + html.escape(k) + "</td>" + "".join(f"<td>{_f(h.get(k))}</td>" for h in history)
                    + "</tr>" for k in keys)
    return (f"<html><head><meta charset='utf-8'><title>{html.escape(cfg.name)}</title></head><body>"
            f"<h1>{html.escape(cfg.name)} (prompt enhancement: enhancer {'frozen' if cfg.enhancer.frozen else 'trained'},"
            f" image {'frozen' if cfg.image.frozen else 'trained'})</h1>{''.join(charts)}<h2>steps</h2><ul>{steps}</ul>"
            f"<h2>metrics</h2><table border=1 cellspacing=0 cellpadding=2><tr><th>metric</th>"
            + "".join(f"<th>{h['step']}</th>" for h in history) + f"</tr>{table}</table></body></html>")
