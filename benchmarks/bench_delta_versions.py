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
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import pin_threads, report  # noqa: E402

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


def build_model(shape: str, device: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.float32), cfg


def bf16_version(model) -> dict:
    """The weights-only version: the fp32 masters rounded to bf16, on the host (``model_state_dict(dtype=...)``)."""
    import torch

    return {k: v.detach().to(torch.bfloat16).to("cpu") for k, v in model.state_dict().items()}


def changed_fraction(a: dict, b: dict) -> float:
    from unirl_core.checkpoint.delta import bits

    changed = sum(int((bits(a[k]) != bits(b[k])).sum()) for k in a)
    return changed / sum(t.numel() for t in a.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=6, help="training steps = versions written to each store")
    ap.add_argument("--lr", type=float, default=QWEN3_MATH_LR)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--root", default=None, help="the stores' directory (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    pin_threads(a.threads)
    import torch

    from unirl_core.checkpoint import CheckpointStore, load_manifest, load_weights
    from unirl_core.checkpoint.delta import DeltaVersions, FullVersions, WeightsMemory, bits
    from unirl_core.config import load_recipe
    from unirl_core.runtime import build

    model, mcfg = build_model(a.shape, a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    root = tempfile.mkdtemp(prefix="unirl-delta-", dir=a.root)
    stores = {"full": CheckpointStore(root, "full", keep_last=a.steps + 1, encoding=FullVersions()),
              "delta": CheckpointStore(root, "delta", keep_last=a.steps + 1,
                                       encoding=DeltaVersions(anchor_every=a.steps + 1))}
    memory = WeightsMemory()
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={root}"])  # storage options for the loads: local
    engines = {k: SimpleNamespace(module=build_model(a.shape, a.device)[0].to(torch.bfloat16)) for k in stores}
    gen = torch.Generator(device=a.device).manual_seed(1)
    rows_data: list[dict] = []
    previous = None
    for step in range(1, a.steps + 1):
        ids = torch.randint(0, mcfg.vocab_size, (a.batch, a.seq), generator=gen, device=a.device)
        t0 = time.perf_counter()
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
            assert all(torch.equal(bits(state[k].cpu()), bits(version[k])) for k in version), f"{kind} engine {step}"
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
    med = lambda key: statistics.median(r[key] for r in deltas)  # noqa: E731
    ratio = lambda num, den: statistics.median(r[num] / r[den] for r in deltas)  # noqa: E731
    nparams = sum(p.numel() for p in model.parameters())
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
           f"Weights-only versions, full vs delta ({a.shape}, {nparams / 1e6:.1f}M parameters, bf16 versions of fp32 "
           f"masters, AdamW lr {a.lr:g}, {a.device}; median over the {len(deltas)} delta versions of {a.steps} steps)",
           ["what", "full", "delta", "delta vs full (median of pairs)"], rows, results,
           notes="full = model.safetensors; delta = zstd (level 1) of the XOR against the previous version "
                 "(checkpoint.weights_encoding: delta). Version 1 is the chain's full anchor in both stores and is "
                 "left out of the medians. Publish: an engine module in bf16 holding the previous version.",
           cell=f"{a.shape}_{a.device}")


if __name__ == "__main__":
    main()
