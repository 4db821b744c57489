"""Publishing over the collective, full weights vs deltas on the wire: bytes and publish time per version, same run.

Two processes, as the pool's separate placement has them: the trainer (this process, rank 0 of two sync groups)
and an engine (a second process). On CPU the groups are gloo over loopback; with ``--device cuda`` and two visible
GPUs the trainer is on GPU 0, the engine on GPU 1, and the groups are NCCL (gpu_suite.sh ``two-gpu``).

The trainer trains the shapes of ``bench_delta_versions`` (a Qwen3-shaped LM with fp32 masters, AdamW at the
qwen3-math recipe's lr; or the SD3.5-M transformer with the recipes' LoRA adapter) and after every step publishes
the version - the masters cast to bf16 on the trainer's device while packing, the shipped ``send(..., cast=...)`` -
twice, alternating which goes first:

- ``full``: ``WeightSender`` (every tensor, bucketed; what ``pool.publish: collective`` sends for full versions);
- ``delta``: ``WeightSender(deltas=True)`` (what it sends with ``checkpoint.weights_encoding: delta``): the changed
  positions (or a bitmap) and new bit patterns against the version before, after the engine voted that it holds
  that one bitwise; the engine applies it in place and checks every tensor's digest.

The engine holds one bf16 module per group (``WeightReceiver``) and checks after every step that the module fed
deltas is bitwise the module fed full weights. Bytes: the buckets plus the header (a delta's header carries one
digest and one [mode, count] per tensor). Publish time: ``send`` on the trainer, from the first gather to the
final vote (every engine has applied and checked); the delta side includes the encode (compare with the kept
base, gather the changed elements) and the digests, which the full side does not compute.

    python benchmarks/bench_delta_wire.py                                       # CPU, gloo, tiny shape
    python benchmarks/bench_delta_wire.py --shape qwen3-0.6b --device cuda      # 2 GPUs, NCCL
    python benchmarks/bench_delta_wire.py --shape sd35m-lora --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_delta_versions import (  # noqa: E402
    QWEN3_MATH_LR,
    SD35M_LORA_LR,
    SD_SHAPES,
    SHAPES,
    build_sd,
    sd_loss,
)
from benchmarks.common import pin_threads, report, row_medians  # noqa: E402

KINDS = ("full", "delta")


def build_lm(shape: str, device: str, layers: int | None):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    cfg = Qwen3Config(**kw, tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.float32), cfg


def engine_module(a, device: str):
    import torch

    if a.shape in SD_SHAPES:
        return build_sd(a.shape, device, engine=True, layers=a.layers)
    return build_lm(a.shape, device, a.layers)[0].to(torch.bfloat16)


def scope_of(a) -> str:
    return "trainable" if a.shape == "sd35m-lora" else "full"


def receiver(a) -> None:
    """The engine: one module per group, each sync received in the trainer's order; checks delta == full."""
    import torch

    from unirl_core.checkpoint.delta import bits
    from unirl_core.weightsync.sync import WeightReceiver, WeightSyncConfig

    device = "cuda:1" if a.device == "cuda" else "cpu"
    modules = {k: engine_module(a, device) for k in KINDS}
    rx = {k: WeightReceiver(WeightSyncConfig(master_port=port, timeout_s=600), modules[k], scope=scope_of(a),
                            device=device) for k, port in zip(KINDS, (a.port_full, a.port_delta))}
    rows = []
    for step in range(1, a.steps + 1):
        row = {"step": step}
        for kind in (KINDS if step % 2 else KINDS[::-1]):
            stats = rx[kind].receive()
            row[f"{kind}_received_delta"] = stats.delta
            row[f"{kind}_apply_s"] = stats.seconds
        a_state, b_state = (rx[k].targets for k in KINDS)
        row["bitwise_equal"] = all(torch.equal(bits(a_state[n]), bits(b_state[n])) for n in a_state)
        rows.append(row)
    for k in KINDS:
        if rx[k].receive() is not None:
            raise SystemExit(f"{k}: expected the sender to close")
        rx[k].close()
    Path(a.out).write_text(json.dumps(rows))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sender(a) -> None:
    import torch

    from unirl_core.checkpoint.delta import bits
    from unirl_core.weightsync.sync import WeightSender, WeightSyncConfig, sync_sources

    sd = a.shape in SD_SHAPES
    device = "cuda:0" if a.device == "cuda" else "cpu"
    if a.lr is None:
        if a.shape == "sd35m-full":
            raise SystemExit("--lr: no shipped recipe fine-tunes SD3.5-M in full; pass the learning rate to measure")
        a.lr = SD35M_LORA_LR if sd else QWEN3_MATH_LR
    model = build_sd(a.shape, device, layers=a.layers) if sd else build_lm(a.shape, device, a.layers)[0]
    vocab = None if sd else model.config.vocab_size
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr)
    ports = {"full": _free_port(), "delta": _free_port()}
    out = Path(a.out or Path(tempfile.gettempdir()) / f"bench_delta_wire_{os.getpid()}.json")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    cmd = [sys.executable, __file__, "--role", "receiver", "--shape", a.shape, "--device", a.device, "--steps",
           str(a.steps), "--threads", str(a.threads), "--port-full", str(ports["full"]), "--port-delta",
           str(ports["delta"]), "--out", str(out)] + (["--layers", str(a.layers)] if a.layers else [])
    proc = subprocess.Popen(cmd, env=env)
    tx = {k: WeightSender(WeightSyncConfig(master_port=ports[k], timeout_s=600), device=device,
                          deltas=k == "delta") for k in KINDS}
    scope = scope_of(a)
    gen = torch.Generator(device=device).manual_seed(1)
    rows, previous = [], None
    sync = (lambda: torch.cuda.synchronize()) if a.device == "cuda" else (lambda: None)
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        if sd:
            loss = sd_loss(model, gen, device, a.batch)
        else:
            ids = torch.randint(0, vocab, (a.batch, a.seq), generator=gen, device=device)
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        row = {"step": step, "train_s": time.perf_counter() - t0, "loss": loss.item()}
        sources = sync_sources(model, scope)
        with torch.no_grad():
            version = {n: t.to(torch.bfloat16) for n, t in sources.items()}  # for the changed fraction only
            if previous is not None:
                changed = sum(int((bits(version[n]) != bits(previous[n])).sum()) for n in version)
                row["changed_fraction"] = changed / sum(t.numel() for t in version.values())
            previous = version
        for kind in (KINDS if step % 2 else KINDS[::-1]):
            sync()
            stats = tx[kind].send(sources, step, scope=scope, cast=torch.bfloat16)
            row[f"{kind}_bytes"] = stats.bytes + stats.header_bytes
            row[f"{kind}_header_bytes"] = stats.header_bytes
            row[f"{kind}_publish_s"] = stats.seconds
            row[f"{kind}_sent_delta"] = stats.delta
        rows.append(row)
        print(f"step {step}: changed {row.get('changed_fraction', 1.0):.4%}, full {row['full_bytes'] / 1e6:.3f} MB "
              f"{row['full_publish_s']:.4f} s, delta {row['delta_bytes'] / 1e6:.3f} MB {row['delta_publish_s']:.4f} s"
              f"{' (delta)' if row['delta_sent_delta'] else ' (full)'}", flush=True)
    for k in KINDS:
        tx[k].close()
    if proc.wait(timeout=600):
        raise SystemExit(f"the engine process failed (rc {proc.returncode})")
    engine_rows = json.loads(out.read_text())
    out.unlink()
    for row, erow in zip(rows, engine_rows, strict=True):
        row.update({k: v for k, v in erow.items() if k != "step"})
    summarize(a, model, rows)


def summarize(a, model, rows: list[dict]) -> None:
    if not all(r["bitwise_equal"] for r in rows):
        raise SystemExit(f"the engine fed deltas differs from the one fed full weights at steps "
                         f"{[r['step'] for r in rows if not r['bitwise_equal']]}")
    deltas = [r for r in rows if r["delta_sent_delta"]]
    if not deltas:
        raise SystemExit("no version travelled as a delta: nothing to compare")
    med, ratio = row_medians(deltas)
    nparams = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows_out = [["bytes per version (MB)", f"{med('full_bytes') / 1e6:.4f}", f"{med('delta_bytes') / 1e6:.4f}",
                 f"{ratio('full_bytes', 'delta_bytes'):.1f}x fewer"],
                ["publish s (send, to the last engine's vote)", f"{med('full_publish_s'):.4f}",
                 f"{med('delta_publish_s'):.4f}", f"{ratio('delta_publish_s', 'full_publish_s'):.2f}x"],
                ["bf16 elements changed per step", "-", f"{med('changed_fraction'):.4%}", "-"]]
    results = {"world": 2, "shape": a.shape, "device": a.device, "backend": "nccl" if a.device == "cuda" else "gloo",
               "layers": a.layers, "lr": a.lr, "steps": a.steps, "parameters": nparams, "batch": a.batch,
               "seq": a.seq, "per_step": rows, "bitwise_equal": True,
               "median": {"full_bytes": med("full_bytes"), "delta_bytes": med("delta_bytes"),
                          "delta_header_bytes": med("delta_header_bytes"),
                          "full_publish_s": med("full_publish_s"), "delta_publish_s": med("delta_publish_s"),
                          "changed_fraction": med("changed_fraction")},
               "median_pair_ratio": {"bytes_full_over_delta": ratio("full_bytes", "delta_bytes"),
                                     "publish_delta_over_full": ratio("delta_publish_s", "full_publish_s")}}
    where = "2 GPUs, NCCL" if a.device == "cuda" else "2 processes, gloo on CPU"
    report("delta_wire",
           f"Collective publish, full vs delta on the wire ({a.shape}{f', {a.layers} layers' if a.layers else ''}, "
           f"{nparams / 1e6:.1f}M trained parameters, bf16 on the wire from fp32 masters, AdamW lr {a.lr:g}, {where}; "
           f"median over the {len(deltas)} delta versions of {a.steps} steps)",
           ["what", "full", "delta", "delta vs full (median of pairs)"], rows_out, results,
           notes="full = WeightSender; delta = WeightSender(deltas=True): changed positions or a bitmap plus the new "
                 "bit patterns, per tensor the fewer bytes, against the version before (version 1 goes in full on "
                 "both sides and is left out of the medians). Bytes include the header. The engine checked after "
                 "every step that its delta-fed module is bitwise its full-fed one.",
           cell=f"{a.shape}_{a.device}" + (f"_{a.layers}layers" if a.layers else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES) + list(SD_SHAPES), default="tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=6, help="training steps = versions published on each side")
    ap.add_argument("--lr", type=float, default=None, help=f"default: {QWEN3_MATH_LR:g} (qwen3-math) for the LM "
                    f"shapes, {SD35M_LORA_LR:g} for sd35m-lora; required for sd35m-full")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="fewer transformer layers (a CPU run of a wide shape)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--role", choices=("sender", "receiver"), default="sender", help=argparse.SUPPRESS)
    ap.add_argument("--port-full", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port-delta", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    pin_threads(a.threads)
    if a.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit(f"--device cuda: needs 2 visible GPUs (trainer on 0, engine on 1), "
                             f"found {torch.cuda.device_count()}")
    if a.role == "receiver":
        receiver(a)
    else:
        sender(a)


if __name__ == "__main__":
    main()
