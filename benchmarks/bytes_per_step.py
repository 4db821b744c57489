"""Bytes written to the artifact store per step at the ``sd35m-pickscore`` shape: pods mode vs pool mode.

Pods mode writes every phase's full SampleBatch as Arrow (rollout, reward, advantage: latents ``[T+1, C, H, W]``
and the replay conditions of every sample) and a full version every step (weights + AdamW state + EMA). Pool
mode writes each phase's projection (media, prompts, log-probs, sigmas, rewards; ``pool/projection.py``) and the
weights every step, the full state every ``checkpoint.every_n_steps``.

Measured through the phase functions (``init_run``, ``rollout_phase``, ``reward_phase``, ``advantage_phase``,
``train_phase``) on CPU with an SD3.5-Medium-shaped transformer of ONE block (random init, bf16; the per-sample
tensors have the real shapes: 512 px latents, 10 steps, CFG 4.5, 77 + 256 prompt tokens x 4096 and a 2048
pooled embedding, seeded random as in ``step_cost_shapes``) for one prompt's group of 24 samples; every column
of a batch file is per sample, so the step's figure is that file x 16 (the recipe's 16 prompts x 24 samples). The
version's files are measured on the one-block model and scaled per file by the ratio of LoRA parameters of the
full 24-block model (counted on the meta device with the bundle's own LoRA targets: 18,776,064, i.e. the
37,552,128 bf16 bytes the pool's NCCL publish sent on the H200s) to the one-block model's. The media is the
stand-in decode's 512 px PNG, the same in both modes. ~50 min on 2 busy cores (the rollout and train step of 24
samples at 512 px); ``--recompute`` redoes the table from a results JSON's measurements.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bytes_per_step.py
    PYTHONPATH=. python benchmarks/bytes_per_step.py --recompute benchmarks/results/bytes_per_step/latest.json
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

CELL = "sd35m_pickscore"  # the record's one shape
SAMPLES, MEASURED = 16 * 24, 24  # sd35m-pickscore: data.prompts_per_step x data.samples_per_prompt; samples measured


def _lora_params(layers: int | None) -> int:
    import torch
    from bench_diffusion_rollout import SD35M
    from diffusers import SD3Transformer2DModel

    from unirl_core.config import load_recipe
    from unirl_core.models.diffusion import LORA_TARGETS
    from unirl_core.models.lora import apply_lora

    lora = load_recipe("sd35m-pickscore", []).diffusion.model.lora
    shape = dict(SD35M)
    if layers:
        shape.update(num_layers=layers, dual_attention_layers=tuple(range(min(13, layers))))
    with torch.device("meta"):
        module = SD3Transformer2DModel(**shape)
    targets = lora.target_modules or LORA_TARGETS["sd3"]  # the bundle's default for SD3 models
    apply_lora(module, rank=lora.rank, alpha=lora.alpha, target_modules=targets)
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def measure() -> dict:
    """Run the phases on the one-block model; the raw sizes (batch files x the step's groups, version files)."""
    import torch
    from safetensors.torch import save_model

    torch.set_num_threads(1)
    from bench_step_cost import PRESETS
    from step_cost_shapes import SPEC_ENV, construct_shaped, worker_hook

    from unirl_core.config import load_recipe
    from unirl_core.io import write_batch
    from unirl_core.loop import local, phases
    from unirl_core.pool.projection import project

    state = Path(tempfile.mkdtemp(prefix="unirl-bytes-"))
    spec = {"shaped": "sd35m", "device": "cpu", "layers": 1}
    (state / "spec.json").write_text(json.dumps(spec))
    save_model(construct_shaped(spec), str(state / "model-init.safetensors"))
    os.environ[SPEC_ENV] = str(state)
    worker_hook()
    local.preflight = lambda _cfg: []
    overrides = [*PRESETS["sd35m-lora"]["overrides"], "diffusion.model.device=cpu", "data.prompts_per_step=1",
                 f"data.samples_per_prompt={MEASURED}", "name=bytes", f"checkpoint.root={state / 'ckpt'}",
                 "loop.total_steps=1"]
    cfg = load_recipe(PRESETS["sd35m-lora"]["recipe"], overrides)
    t0 = time.perf_counter()
    ckpt = phases.init_run(cfg, resume_from="never")
    batch, _ = phases.rollout_phase(cfg, ckpt, step=1)
    scored, _ = phases.reward_phase(cfg, batch)
    adv, _ = phases.advantage_phase(cfg, scored, ckpt)
    new, _ = phases.train_phase(cfg, adv, ckpt, step=1)
    arrow_full, arrow_proj = {}, {}
    for name, b in (("rollout", batch), ("reward", scored), ("advantage", adv)):
        for kind, out, bb in (("full", arrow_full, b), ("projection", arrow_proj, project(b))):
            path = state / f"{name}.{kind}.arrow"
            write_batch(bb, path)
            out[name] = path.stat().st_size * SAMPLES // MEASURED
    files = {p.name: p.stat().st_size for p in Path(new.uri).iterdir() if p.is_file()}
    shutil.rmtree(state, ignore_errors=True)
    return {"samples_per_step": SAMPLES, "samples_measured": MEASURED, "arrow_full_bytes": arrow_full,
            "arrow_projection_bytes": arrow_proj, "version_files_one_block": files,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recompute", help="this script's record (latest.json): its measurements, today's LoRA counts")
    args = ap.parse_args()
    if args.recompute:
        raw = json.loads(Path(args.recompute).read_text())["cells"][CELL]["results"]
        raw = {k: raw[k] for k in ("arrow_full_bytes", "arrow_projection_bytes", "version_files_one_block",
                                   "seconds")} | {"samples_per_step": raw.get("samples_per_step", SAMPLES),
                                                  "samples_measured": raw.get("samples_measured", 24)}
    else:
        raw = measure()
    arrow_full, arrow_proj, files = raw["arrow_full_bytes"], raw["arrow_projection_bytes"], raw["version_files_one_block"]
    lora_24, lora_1 = _lora_params(None), _lora_params(1)
    scale = lora_24 / lora_1
    trainable = {k: int(v * scale) for k, v in files.items() if k in ("model.safetensors", "ema.safetensors",
                                                                       "train_state.pt")}
    small = {k: v for k, v in files.items() if k not in trainable}
    weights = trainable.get("model.safetensors", 0) + sum(small.values())
    full_version = sum(trainable.values()) + sum(small.values())
    pods = sum(arrow_full.values()) + full_version
    pool = sum(arrow_proj.values()) + weights
    out = {"shape": "sd35m-pickscore: 16 prompts x 24 samples, 512 px, 10 steps, CFG 4.5, LoRA r32, EMA", **raw,
           "lora_params_24_blocks": lora_24, "lora_params_1_block": lora_1, "lora_scale_24_blocks": scale,
           "version_full_bytes": full_version, "version_weights_bytes": weights, "pods_bytes_per_step": pods,
           "pool_bytes_per_step_between_full_states": pool, "recomputed": bool(args.recompute)}
    from common import report

    gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
    rows = [["pods (today's default)", gb(sum(arrow_full.values())), gb(full_version), gb(pods), "1.000x"],
            ["pool, steps between full states", gb(sum(arrow_proj.values())), gb(weights), gb(pool),
             f"{pool / pods:.4f}x"],
            ["pool, a step that also writes the full state", gb(sum(arrow_proj.values())), gb(full_version),
             gb(sum(arrow_proj.values()) + full_version), f"{(sum(arrow_proj.values()) + full_version) / pods:.4f}x"]]
    report("bytes_per_step", "Bytes written to the artifact store per step, sd35m-pickscore shape",
           ["mode", "Arrow (rollout + reward + advantage)", "checkpoint version", "total per step", "vs pods"],
           rows, out, notes=(f"Arrow per phase (full / projection): {', '.join(f'{k} {gb(v)} / {gb(arrow_proj[k])}' for k, v in arrow_full.items())}. "
                             f"Measured on {raw['samples_measured']} samples x {SAMPLES // raw['samples_measured']}; version files measured on a "
                             f"1-block SD3.5-M-shaped model x {scale:.1f} (LoRA parameters of 24 blocks / 1 block): "
                             f"{', '.join(f'{k} {gb(v)}' for k, v in trainable.items())} (train_state.pt's RNG and counters scaled "
                             "too: a few KB). CPU, phase functions." + (" Table recomputed from the measurements "
                                                                        "above (--recompute)." if args.recompute else "")), cell=CELL)


if __name__ == "__main__":
    main()
