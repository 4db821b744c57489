"""Delta versions vs full versions: bytes per weights-only version, write time and publish time, same run.

A Qwen3-shaped causal LM (random init from its config, no download) trains a few steps the way a full fine-tune
does: fp32 master weights, AdamW at a fixed learning rate (default: the qwen3-math recipe's 1e-6, past its warm-up),
a language-model loss on random tokens. After every step the weights-only version - the masters rounded to bf16,
what ``checkpoint.every_n_steps`` writes between full states - is written to two stores, alternating:

- ``full``: ``CheckpointStore`` with ``FullVersions`` (``model.safetensors``, the default);
- ``delta``: ``CheckpointStore`` with ``DeltaVersions`` and the writer's memory (``WeightsMemory``): the
  zstd-compressed XOR against the previous version (``checkpoint.weights_encoding: delta``).

Write time is ``CheckpointStore.save`` (payload, fsync, manifest), the call a ``VersionWriter``'s thread makes.
Publish time is ``runtime.build.load_policy_weights`` into an engine module (bf16, on ``--device``) that holds the
previous version: the full version read, verified and copied in, vs the delta read, XOR-ed in place and the result
checked against the version's digest. Every version of both stores is read back and compared bit for bit.

Not the shipped trainer: the updates come from torch's AdamW on a plain LM loss, not ``TrainBackend``'s GRPO
replay; what sets a delta's size is how many bf16 elements an update moves across a rounding boundary, which
AdamW's per-element step of about ``lr`` decides whatever the loss.

    python benchmarks/bench_delta_versions.py                                  # CPU, tiny shape (the CPU record)
    python benchmarks/bench_delta_versions.py --shape qwen3-0.6b --device cuda # the issue's shape, on a GPU
    python benchmarks/bench_delta_versions.py --shape sd35m-lora --device cuda # SD3.5-M transformer, LoRA r32
    python benchmarks/bench_delta_versions.py --shape sd35m-full --device cuda --lr 1e-5  # SD3.5-M full fine-tune

The SD3.5-M shapes train the SD3.5-Medium-shaped transformer (random init, ``bench_diffusion_rollout.SD35M``) on a
flow-matching MSE at 512 px (64x64 latents, 333 text tokens of width 4096, seeded random conditions), forward in
bf16 autocast: ``sd35m-full`` with fp32 masters of every weight, ``sd35m-lora`` with the recipes' adapter (r32,
alpha 64, the SD3 targets ``LORA_TARGETS["sd3"]``) in fp32 on a frozen bf16 base, the version being the adapter
alone (the trainable scope) rounded to bf16 (what ``model_state_dict(dtype=compute_dtype)`` writes).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import pin_threads, report, row_medians  # noqa: E402

SHAPES = {
    # Qwen3-0.6B (tied embedding, ~596M parameters)
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151_936),
    # the same architecture, small enough for a CPU run in seconds (~0.9M parameters)
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=384, vocab_size=4096),
    # between the two (~60M parameters): per-byte costs on a CPU, where the tiny shape is all fixed costs
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  intermediate_size=1536, vocab_size=32_000),
}
QWEN3_MATH_LR = 1.0e-6  # unirl_core/config/recipes/qwen3-math.yaml, train.lr
SD_SHAPES = ("sd35m-full", "sd35m-lora")
SD35M_LORA_LR = 3.0e-4  # unirl_core/config/recipes/sd35m-pickscore.yaml, train.lr


def build_sd(shape: str, device: str, *, engine: bool = False, layers: int | None = None):
    """The SD3.5-M-shaped transformer: fp32 masters (full) or a bf16 base with fp32 adapter (lora); ``engine``: the
    whole module in bf16, as a rollout engine holds it."""
    import torch
    from diffusers import SD3Transformer2DModel

    from benchmarks.bench_diffusion_rollout import SD35M
    from unirl_core.models.diffusion import LORA_TARGETS
    from unirl_core.models.lora import apply_lora

    lora = shape == "sd35m-lora"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if (engine or lora) else torch.float32)
    try:
        torch.manual_seed(0)
        shape_kw = dict(SD35M)
        if layers:  # a CPU plumbing check of the full-width model
            shape_kw.update(num_layers=layers, dual_attention_layers=tuple(range(min(13, layers))))
        with torch.device(device):
            model = SD3Transformer2DModel(**shape_kw)
    finally:
        torch.set_default_dtype(prev)
    if engine or lora:
        model = model.to(torch.bfloat16)  # buffers too (SD3's pos_embed is built in fp32), as the engines' .to(dtype)
    if lora:
        apply_lora(model, rank=32, alpha=64.0, target_modules=LORA_TARGETS["sd3"])
        if not engine:
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
    return model


def sd_loss(model, gen, device: str, batch: int):
    import torch

    lat = torch.randn(batch, 16, 64, 64, generator=gen, device=device)
    ctx = torch.randn(batch, 333, 4096, generator=gen, device=device)
    pooled = torch.randn(batch, 2048, generator=gen, device=device)
    t = torch.rand(batch, generator=gen, device=device) * 1000
    target = torch.randn(batch, 16, 64, 64, generator=gen, device=device)
    with torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16):
        out = model(hidden_states=lat, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t).sample
    return torch.nn.functional.mse_loss(out.float(), target)


def build_model(shape: str, device: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.float32), cfg


def bf16_version(model) -> dict:
    """The weights-only version: the fp32 masters rounded to bf16, on the host (``model_state_dict(dtype=...)``);
    with frozen parameters (LoRA), the trainable ones alone."""
    import torch

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    state = model.state_dict()
    if len(trainable) < len(list(model.parameters())):
        state = {k: v for k, v in state.items() if k in trainable}
    return {k: v.detach().to(torch.bfloat16).to("cpu") for k, v in state.items()}


def changed_fraction(a: dict, b: dict) -> float:
    from unirl_core.checkpoint.delta import bits

    changed = sum(int((bits(a[k]) != bits(b[k])).sum()) for k in a)
    return changed / sum(t.numel() for t in a.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES) + list(SD_SHAPES), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=6, help="training steps = versions written to each store")
    ap.add_argument("--lr", type=float, default=None,
                    help=f"default: {QWEN3_MATH_LR:g} (qwen3-math) for the LM shapes, {SD35M_LORA_LR:g} (sd35m-* "
                         "recipes) for sd35m-lora; required for sd35m-full (no shipped full fine-tune recipe)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--root", default=None, help="the stores' directory (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None, help="sd35m-*: fewer transformer blocks (a CPU plumbing "
                    "check, not a measurement)")
    a = ap.parse_args()
    pin_threads(a.threads)
    import torch

    from unirl_core.checkpoint import CheckpointStore, load_manifest, load_weights
    from unirl_core.checkpoint.delta import DeltaVersions, FullVersions, WeightsMemory, bits
    from unirl_core.config import load_recipe
    from unirl_core.runtime import build

    sd = a.shape in SD_SHAPES
    if a.lr is None:
        if a.shape == "sd35m-full":
            raise SystemExit("--lr: no shipped recipe fine-tunes SD3.5-M in full; pass the learning rate to measure")
        a.lr = SD35M_LORA_LR if sd else QWEN3_MATH_LR
    if sd:
        model = build_sd(a.shape, a.device, layers=a.layers)
    else:
        model, mcfg = build_model(a.shape, a.device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr)
    root = tempfile.mkdtemp(prefix="unirl-delta-", dir=a.root)
    stores = {"full": CheckpointStore(root, "full", keep_last=a.steps + 1, encoding=FullVersions()),
              "delta": CheckpointStore(root, "delta", keep_last=a.steps + 1,
                                       encoding=DeltaVersions(anchor_every=a.steps + 1))}
    memory = WeightsMemory()
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={root}"])  # storage options for the loads: local
    engines = {k: SimpleNamespace(module=build_sd(a.shape, a.device, engine=True, layers=a.layers) if sd else
                                  build_model(a.shape, a.device)[0].to(torch.bfloat16)) for k in stores}
    gen = torch.Generator(device=a.device).manual_seed(1)
    rows_data: list[dict] = []
    previous = None
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        if sd:
            loss = sd_loss(model, gen, a.device, a.batch)
        else:
            ids = torch.randint(0, mcfg.vocab_size, (a.batch, a.seq), generator=gen, device=a.device)
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.device != "cpu":
            torch.cuda.synchronize()
        train_s = time.perf_counter() - t0
        version = bf16_version(model)
        row = {"step": step, "train_s": train_s, "loss": loss.item(),
               "changed_fraction": changed_fraction(version, previous) if previous is not None else 1.0}
        for kind, store in stores.items():  # alternating, the same version
            t0 = time.perf_counter()
            ref = store.save(step, weights=version, policy_version=step,
                             memory=memory if kind == "delta" else None)
            row[f"{kind}_write_s"] = time.perf_counter() - t0
            files = load_manifest(ref).files
            row[f"{kind}_bytes"] = sum(int(f["bytes"]) for f in files.values())
            if a.device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            applied = build.load_policy_weights(engines[kind], ref, cfg)
            if a.device != "cpu":
                torch.cuda.synchronize()
            row[f"{kind}_publish_s"] = time.perf_counter() - t0
            row[f"{kind}_applied_delta"] = bool(applied)
            got = load_weights(ref)
            assert all(torch.equal(bits(got[k]), bits(version[k])) for k in version), f"{kind} {step} differs"
            state = engines[kind].module.state_dict()
            bad = [k for k in version  # a module tensor kept in fp32 (SD3's pos_embed buffer) holds the bf16 value
                   if not torch.equal(bits(state[k].cpu().to(version[k].dtype)), bits(version[k]))]
            assert not bad, f"{kind} engine {step}: {bad[:3]}"
        row["delta_chain"] = len(load_manifest(stores["delta"].versions()[-1]).chain)
        rows_data.append(row)
        previous = version
        print(f"step {step}: changed {row['changed_fraction']:.4%}, full {row['full_bytes'] / 1e6:.2f} MB "
              f"{row['full_write_s']:.3f} s, delta {row['delta_bytes'] / 1e6:.3f} MB {row['delta_write_s']:.3f} s",
              flush=True)
    shutil.rmtree(root, ignore_errors=True)

    deltas = [r for r in rows_data if r["delta_applied_delta"]]  # the versions written and published as deltas
    if not deltas:
        raise SystemExit("no version was written as a delta: nothing to compare")
    med, ratio = row_medians(deltas)
    nparams = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = [["bytes per version (MB)", f"{med('full_bytes') / 1e6:.3f}", f"{med('delta_bytes') / 1e6:.3f}",
             f"{ratio('full_bytes', 'delta_bytes'):.1f}x smaller"],
            ["write s (CheckpointStore.save)", f"{med('full_write_s'):.4f}", f"{med('delta_write_s'):.4f}",
             f"{ratio('delta_write_s', 'full_write_s'):.2f}x"],
            ["publish s (load_policy_weights)", f"{med('full_publish_s'):.4f}", f"{med('delta_publish_s'):.4f}",
             f"{ratio('delta_publish_s', 'full_publish_s'):.2f}x"],
            ["bf16 elements changed per step", "-", f"{med('changed_fraction'):.4%}", "-"]]
    results = {"shape": a.shape, "device": a.device, "lr": a.lr, "steps": a.steps, "parameters": nparams,
               "batch": a.batch, "seq": a.seq, "per_step": rows_data,
               "median": {"full_bytes": med("full_bytes"), "delta_bytes": med("delta_bytes"),
                          "full_write_s": med("full_write_s"), "delta_write_s": med("delta_write_s"),
                          "full_publish_s": med("full_publish_s"), "delta_publish_s": med("delta_publish_s"),
                          "changed_fraction": med("changed_fraction")},
               "median_pair_ratio": {"bytes_full_over_delta": ratio("full_bytes", "delta_bytes"),
                                     "write_delta_over_full": ratio("delta_write_s", "full_write_s"),
                                     "publish_delta_over_full": ratio("delta_publish_s", "full_publish_s")}}
    report("delta_versions",
           f"Weights-only versions, full vs delta ({a.shape}, {nparams / 1e6:.1f}M trained parameters, bf16 versions of fp32 "
           f"masters, AdamW lr {a.lr:g}, {a.device}; median over the {len(deltas)} delta versions of {a.steps} steps)",
           ["what", "full", "delta", "delta vs full (median of pairs)"], rows, results,
           notes="full = model.safetensors; delta = zstd (level 1) of the XOR against the previous version "
                 "(checkpoint.weights_encoding: delta). Version 1 is the chain's full anchor in both stores and is "
                 "left out of the medians. Publish: an engine module in bf16 holding the previous version.",
           cell=f"{a.shape}_{a.device}" + (f"_{a.layers}layers" if a.layers else ""))


if __name__ == "__main__":
    main()
