"""Reward scoring on CPU: OCR / JPEG scorer throughput, and remote vs local scoring of one batch.

- OCR throughput with the fast rapidocr settings vs rapidocr's defaults (the baseline), same images.
- JPEG throughput vs bare PNG decoding of the same images (the floor every image scorer pays).
- A 64-image batch scored by RewardService locally and through the reward server (a subprocess on
  127.0.0.1, Arrow IPC request with the PNG bytes as they are); target: remote <= 1.2x local.

Images are 256x256 PNGs: text rendered over a smooth gradient with mild noise (a stand-in for
generated images with a text prompt). One thread everywhere (OMP_NUM_THREADS=1, ORT 1 thread).
Timings are medians.

Run: python benchmarks/bench_reward.py [--quick] [--only throughput|remote]
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import median_time, pin_threads, report  # noqa: E402
from unirl_core.reward import RewardConfig, RewardService, ScoreItem, build_scorer  # noqa: E402
from unirl_core.reward.scorers.image import decode_image  # noqa: E402
from unirl_core.types import DiffusionSamplingParams, PromptRecord, SampleBatch  # noqa: E402

WORDS = ["OPEN", "FLOW GRPO", "HELLO", "REWARD", "CAFE 24H", "EXIT", "SALE", "NO PARKING"]


def make_png(i: int, size: int = 256) -> bytes:
    rng = np.random.default_rng(i)
    low = rng.integers(60, 255, size=(4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(low).resize((size, size), Image.BICUBIC)
    ImageDraw.Draw(img).text((16, size // 2 - 20), WORDS[i % len(WORDS)], fill="black",
                             font=ImageFont.load_default(size=size // 8))
    arr = np.asarray(img).astype(np.int16) + rng.integers(-6, 6, size=(size, size, 3))
    out = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def make_batch(n: int) -> SampleBatch:
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=f'a sign that says "{WORDS[i % len(WORDS)]}"') for i in range(n)]
    batch = SampleBatch.from_prompts(recs, samples_per_prompt=1, kind="diffusion",
                                     sampling=DiffusionSamplingParams(sigmas=(1.0, 0.0), height=256, width=256))
    for i, s in enumerate(batch):
        s.generated.media = make_png(i)
    return batch


def throughput(items: list[ScoreItem], args, repeats: int) -> tuple[list, dict]:
    from rapidocr import RapidOCR

    fast = build_scorer("ocr", num_threads=1)
    default_engine = RapidOCR(params={"Global.log_level": "warning",
                                      "EngineConfig.onnxruntime.intra_op_num_threads": 1,
                                      "EngineConfig.onnxruntime.inter_op_num_threads": 1})
    ocr_items = items[: args.ocr_images]
    ocr_repeats = min(repeats, 3)  # the default-settings baseline takes ~1 s per image
    t_fast = median_time(lambda: fast(ocr_items), repeats=ocr_repeats)
    t_default = median_time(lambda: [default_engine(np.asarray(decode_image(it))) for it in ocr_items],
                            repeats=ocr_repeats)
    jpeg = build_scorer("jpeg_compressibility")
    t_jpeg = median_time(lambda: jpeg(items), repeats=repeats)
    t_decode = median_time(lambda: [decode_image(it) for it in items], repeats=repeats)
    n_ocr, n = len(ocr_items), len(items)
    rows = [
        ["ocr (fast settings)", f"{n_ocr / t_fast:.1f}", f"{t_default / t_fast:.1f}x vs rapidocr defaults"],
        ["ocr (rapidocr defaults)", f"{n_ocr / t_default:.1f}", "1.0x (baseline)"],
        ["jpeg_compressibility", f"{n / t_jpeg:.1f}", f"{t_jpeg / t_decode:.2f}x the cost of PNG decode alone"],
        ["png decode only", f"{n / t_decode:.1f}", "floor"],
    ]
    data = {"ocr_fast_img_per_s": n_ocr / t_fast, "ocr_default_img_per_s": n_ocr / t_default,
            "ocr_speedup_vs_default": t_default / t_fast, "jpeg_img_per_s": n / t_jpeg,
            "png_decode_img_per_s": n / t_decode, "jpeg_cost_vs_decode": t_jpeg / t_decode}
    return rows, data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(token: str) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    env = {**os.environ, "UNIRL_BENCH_TOKEN": token, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "unirl_core.reward.server", "--port", str(port),
                             "--token-env", "UNIRL_BENCH_TOKEN", "--log-level", "warning"], cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("reward server did not start")


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def paired(fa, fb, repeats: int, server_pid: int) -> dict:
    """Run ``fa`` (local) and ``fb`` (remote) alternately after one warm-up each.

    Alternating keeps load changes on a shared machine from landing on one side only. Besides
    wall time, CPU time is summed over this process and the server, which scheduling delays
    on a busy machine do not inflate.
    """
    fa(), fb()
    wall_a, wall_b, cpu_a, cpu_b = [], [], [], []
    for _ in range(repeats):
        for fn, wall, cpu in ((fa, wall_a, cpu_a), (fb, wall_b, cpu_b)):
            c0, s0, t0 = time.process_time(), _proc_cpu_s(server_pid), time.perf_counter()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0 + _proc_cpu_s(server_pid) - s0)
    med = statistics.median
    return {"local_s": med(wall_a), "remote_s": med(wall_b),
            "wall_ratio_median_of_pairs": med(b / a for a, b in zip(wall_a, wall_b)),
            "wall_ratio_best_of_n": min(wall_b) / min(wall_a),
            "cpu_ratio": sum(cpu_b) / sum(cpu_a), "repeats": repeats}


def remote_vs_local(batch: SampleBatch, repeats: int) -> tuple[list, dict]:
    """JPEG (the cheapest scorer: worst case for transport overhead) with one request and with the
    default chunking; OCR (a realistic per-image cost) with the default chunking."""
    token = "bench-token"
    os.environ["UNIRL_BENCH_TOKEN"] = token
    proc, url = start_server(token)
    cases = [("jpeg_compressibility", {}, len(batch), 1), ("jpeg_compressibility", {}, 32, 2),
             ("ocr", {"num_threads": 1}, 32, 2)]
    rows, data = [], {}
    try:
        for name, kwargs, batch_size, in_flight in cases:
            comps = [(name, 1.0, kwargs)]
            local = RewardService(RewardConfig(components=comps, batch_size=batch_size))
            remote = RewardService(RewardConfig(components=comps, backend="remote", remote_url=url,
                                                remote_token_env="UNIRL_BENCH_TOKEN", batch_size=batch_size,
                                                remote_max_in_flight=in_flight))
            # JPEG is cheap, so many pairs; OCR pairs take 10-20 s each on a busy 2-core box.
            reps = 2 * repeats + 1 if name == "jpeg_compressibility" else max(1, repeats // 4)
            r = paired(lambda: local.score(batch), lambda: remote.score(batch), reps, proc.pid)
            remote.close()
            label = f"{name}, batch_size {batch_size}, {in_flight} in flight"
            rows.append([label, f"{r['local_s'] * 1e3:.0f}", f"{r['remote_s'] * 1e3:.0f}",
                         f"{r['wall_ratio_median_of_pairs']:.2f}", f"{r['wall_ratio_best_of_n']:.2f}",
                         f"{r['cpu_ratio']:.2f}", "yes" if r["wall_ratio_median_of_pairs"] <= 1.2 else "NO"])
            data[label] = r
    finally:
        proc.terminate()
        proc.wait(10)
    return rows, data


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument("--only", choices=("all", "throughput", "remote"), default="all", help="which part to run")
    args = p.parse_args()
    pin_threads(1)
    n, repeats = (8, 2) if args.quick else (64, 15)
    args.ocr_images = 4 if args.quick else 16
    batch = make_batch(n)
    items = [ScoreItem.from_part(s.generated) for s in batch]
    from importlib.metadata import version
    versions = {m: version(m) for m in ("rapidocr", "onnxruntime", "fastapi", "uvicorn", "httpx", "math-verify")}
    prefix = "quick_" if args.quick else ""
    header = ["case", "local ms", "remote ms", "wall ratio (median of pairs)", "wall ratio (best of N)",
              "CPU ratio (client+server)", "<= 1.2x"]
    if args.only in ("all", "throughput"):
        load_before = os.getloadavg()[0]
        rows_t, data_t = throughput(items, args, repeats)
        load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
        report("reward", "Reward scorer throughput (CPU, 1 thread, 256x256 PNG)",
               ["scorer", "images/s", "vs baseline (same run)"], rows_t, {**data_t, "versions": versions},
               notes=f"OCR on {args.ocr_images} images (median of {min(repeats, 3)} runs), JPEG and decode on "
                     f"{n} (median of {repeats}). "
                     f"Versions: {versions}. Shared machine: {load}.", cell=prefix + "throughput")
    if args.only == "throughput":
        return
    load_before = os.getloadavg()[0]
    rows_r, data_r = remote_vs_local(batch, repeats)
    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    report("reward", f"Remote vs local scoring of a {n}-image batch (CPU, 256x256 PNG)",
           header, rows_r, {**data_r, "versions": versions, "load": load},
           notes="Server: `python -m unirl_core.reward.server` on 127.0.0.1, one scoring thread; the client "
                 "sends Arrow IPC with raw PNG bytes. Both sides share the same CPU cores. Local and remote "
                 f"runs alternate; JPEG pairs: {2 * repeats + 1}, OCR pairs: {max(1, repeats // 4)}. "
                 "CPU ratio sums client and server CPU time (insensitive to scheduling delays on a loaded "
                 f"machine). Shared machine: {load}.", cell=prefix + "remote")


if __name__ == "__main__":
    main()
