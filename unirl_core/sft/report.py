"""What an SFT run shows: a loss curve and, for diffusion, images sampled from a version.

``sample_images`` runs the RL rollout engine (``TrainsideDiffusionEngine``) with a deterministic ODE schedule,
so the previews are exactly what the RL loop would see from this model at the same settings.
``write_sft_report`` renders ``<root>/<run>/report/index.html`` from ``sft_metrics.jsonl`` plus a sample strip.
"""

from __future__ import annotations

import base64
import html
import json
import logging

import fsspec

from unirl_core.checkpoint import CheckpointRef, load_weights
from unirl_core.sft.config import SFTConfig

log = logging.getLogger(__name__)

REPORT_DIR = "report"


def sample_images(bundle, prompts: list[str], *, height: int, width: int, num_steps: int = 20, shift: float = 3.0,
                  guidance_scale: float = 1.0, seed: int = 0) -> list[bytes]:
    """PNG bytes of one image per prompt, ODE sampling through the rollout engine (deterministic per seed)."""
    from unirl_core.rollout.diffusion import (
        DiffusionEngineConfig,
        TrainsideDiffusionEngine,
    )
    from unirl_core.sde.schedules import flow_sigmas
    from unirl_core.types import (
        DiffusionSamplingParams,
        NoiseRecipe,
        PromptRecord,
        SampleBatch,
    )

    sampling = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=num_steps, shift=shift), sde_type="ode",
                                       noise_level=0.0, guidance_scale=guidance_scale, height=height, width=width)
    records = [PromptRecord(prompt_id=f"p{i:05d}", prompt=p) for i, p in enumerate(prompts)]
    request = SampleBatch.from_prompts(records, samples_per_prompt=1, kind="diffusion", sampling=sampling)
    engine = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=16))
    out = engine.generate(request, noise=NoiseRecipe(base_seed=seed))
    return [p.media for p in out.generated]


def version_bundle(cfg: SFTConfig, ckpt: CheckpointRef, *, ema: bool = False):
    """A fresh bundle of the run's model holding version ``ckpt``'s weights (or its EMA weights)."""
    from unirl_core.runtime.build import apply_policy_weights
    from unirl_core.sft.phases import fresh_bundle

    bundle = fresh_bundle(cfg)
    apply_policy_weights(bundle, load_weights(ckpt, storage_options=cfg.checkpoint.storage_options, ema=ema),
                         where=ckpt.uri)
    return bundle


def preview_prompts(cfg: SFTConfig, n: int = 8) -> list[str]:
    """Captions of the run's first ``n`` records (deterministic)."""
    from unirl_core.sft.phases import records

    return [r.caption for r in records(cfg)[:n]]


def _read_metrics(cfg: SFTConfig) -> list[dict]:
    from unirl_core.sft.local import METRICS_FILE

    uri = f"{cfg.checkpoint.root.rstrip('/')}/{cfg.name}/{METRICS_FILE}"
    fs, path = fsspec.core.url_to_fs(uri, **cfg.checkpoint.storage_options)
    if not fs.exists(path):
        return []
    return [json.loads(line) for line in fs.cat_file(path).decode().splitlines() if line.strip()]


def write_sft_report(cfg: SFTConfig, ckpt: CheckpointRef, *, samples: int = 8) -> str:
    """``<root>/<run>/report/index.html``: loss and grad-norm curves over every step so far, the config, and for
    diffusion ``samples`` images of version ``ckpt`` (its EMA weights with ``loop.export_ema``). Returns the URI."""
    from unirl_core.config.loader import to_dict
    from unirl_core.report.charts import line_chart_svg

    rows = _read_metrics(cfg)
    charts = [line_chart_svg([(r["step"], r[k]) for r in rows if k in r], title=k) for k in ("sft/loss", "sft/grad_norm")]
    strip = ""
    if cfg.family == "diffusion" and samples > 0:
        bundle = version_bundle(cfg, ckpt, ema=cfg.loop.export_ema)
        prompts = preview_prompts(cfg, samples)
        pngs = sample_images(bundle, prompts, height=cfg.diffusion.height, width=cfg.diffusion.width)
        strip = "".join(
            f"<figure><img width='96' style='image-rendering:pixelated' src='data:image/png;base64,"
            f"{base64.b64encode(png).decode()}'><figcaption>{html.escape(p)}</figcaption></figure>"
            for p, png in zip(prompts, pngs))
        strip = f"<h2>samples of step {ckpt.step}</h2><div style='display:flex;flex-wrap:wrap;gap:8px'>{strip}</div>"
    body = (f"<h1>SFT run {html.escape(cfg.name)}</h1><p>published: step {ckpt.step} ({html.escape(ckpt.uri)}), "
            f"{len(rows)} steps logged</p>{''.join(charts)}{strip}"
            f"<h2>config</h2><pre>{html.escape(json.dumps(to_dict(cfg), indent=1, sort_keys=True))}</pre>")
    uri = f"{cfg.checkpoint.root.rstrip('/')}/{cfg.name}/{REPORT_DIR}/index.html"
    fs, path = fsspec.core.url_to_fs(uri, **cfg.checkpoint.storage_options)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(cfg.name)}</title></head>"
                f"<body>{body}</body></html>")
    log.info("SFT report: %s", uri)
    return uri
