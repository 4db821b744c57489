"""Shared helpers for benchmarks: environment record, timing, table output and the results records.

Every benchmark writes one record, ``results/<benchmark>/latest.json`` + ``latest.md``: the environment (hardware,
versions), the git commit it ran at (with a dirty flag) and the date. A benchmark measured in variants (a preset, a
device, a sweep's configurations) keeps one *cell* per variant in that record; running a variant replaces its cell.
History lives in git: a re-run overwrites ``latest``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent


def pin_threads(n: int = 1) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    import torch

    torch.set_num_threads(n)


def environment() -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
           "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for mod in ("pyarrow", "diffusers", "transformers", "flytekit"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return env


def median_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def row_medians(rows: list[dict]):
    """``med(key)``: the median of ``key`` over ``rows``; ``ratio(num, den)``: the median of the per-row ratios
    ``num / den`` (pairs measured in the same row, so the ratio is the same-run comparison)."""
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def ratio(num: str, den: str) -> float:
        return statistics.median(r[num] / r[den] for r in rows)

    return med, ratio


def format_table(header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def report(name: str, title: str, header: list[str], rows: list[list], data: dict, notes: str = "", *,
           cell: str | None = None, headline: str | None = None, description: str | None = None,
           results_dir: Path = RESULTS) -> Path:
    """Print a table and write it with ``data`` as the record of benchmark ``name`` (its ``cell``, if given)."""
    table = format_table(header, rows)
    print(f"\n{title}\n{table}\n")
    md = f"### {title}\n\n{table}\n" + (f"\n{notes}\n" if notes else "")
    return write_record(name, data, md, cell=cell, headline=headline, description=description,
                        results_dir=results_dir)


def provenance() -> dict:
    """The commit this run measured (``dirty``: uncommitted changes in the tree) and the date, ISO 8601 UTC."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""
    # the records themselves do not count: a suite writing several records stays clean after its first
    dirty = bool(git("status", "--porcelain", "-uno", "--", ".", ":!benchmarks/results"))
    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()}


def _script_description() -> str:
    doc = (getattr(sys.modules.get("__main__"), "__doc__", None) or "").strip()
    return doc.split("\n\n", 1)[0].replace("\n", " ")


def _script() -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        return Path(main).resolve().relative_to(REPO).as_posix() if main else ""
    except ValueError:
        return Path(main).name


def write_record(benchmark: str, results, md: str, *, cell: str | None = None, env: dict | None = None,
                 headline: str | None = None, description: str | None = None, log: str | None = None,
                 results_dir: Path = RESULTS) -> Path:
    """Write ``results_dir/<benchmark>/latest.json`` and ``latest.md``; returns the json path.

    ``results`` is the measurement (any JSON), ``md`` its table in markdown. With ``cell`` the record keeps the
    other cells and replaces this one; ``description`` (one sentence) defaults to the record's or the script's.
    """
    if "/" in benchmark or (cell and "/" in cell):
        raise ValueError(f"benchmark {benchmark!r} / cell {cell!r}: a name, not a path")
    path = Path(results_dir) / benchmark / "latest.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    if old and ("cells" in old) != (cell is not None):
        # one shape per record: a run written over a record of cells (or a cell into a one-run record) would drop
        # the runs already there
        have = f"cells {sorted(old['cells'])}" if "cells" in old else "one run, no cells"
        raise ValueError(f"{path}: the record holds {have}; write this run "
                         f"{'as one of its cells (cell=...)' if 'cells' in old else 'without a cell'}, or move the "
                         f"record away first")
    entry = {**provenance(), "env": env if env is not None else environment(), "md": md, "results": results}
    if log:
        entry["log"] = log
    record = {"benchmark": benchmark, "description": description or old.get("description") or _script_description(),
              "script": _script() or old.get("script", "")}
    if cell is None:
        record.update(entry)
        if headline:
            record["headline"] = headline
    else:
        if headline or old.get("headline"):
            record["headline"] = headline or old["headline"]
        cells = dict(old.get("cells", {}))
        cells[cell] = entry
        record["cells"] = cells
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    path.with_suffix(".md").write_text(render_md(record))
    return path


def when(entry: dict) -> str:
    """The date of a record or cell: ``date`` when a script wrote it, ``recorded`` (git) when migrated."""
    return entry.get("date") or entry.get("recorded") or ""


def hardware_of(env) -> str:
    if isinstance(env, dict):
        hw = env.get("gpu") or env.get("device_name") or env.get("cpu") or env.get("hardware")
        return str(hw) if hw else ", ".join(f"{k} {v}" for k, v in list(env.items())[:3]) or "not recorded"
    return str(env) if env else "not recorded"


def _provenance_line(e: dict) -> str:
    commit = (e.get("commit") or "unknown")[:10] + (" (dirty)" if e.get("dirty") else "")
    how = "recorded" if "recorded" in e and "date" not in e else "date"
    return f"commit `{commit}`, {how} {when(e)}"


def _env_line(env) -> str:
    if isinstance(env, dict):
        return ", ".join(f"{k} {v}" for k, v in env.items())
    return str(env or "not recorded")


def _entry_md(e: dict) -> str:
    body = e.get("md", "").strip()
    if e.get("log"):
        body += "\n\nLog:\n\n```text\n" + e["log"].rstrip() + "\n```"
    for name, text in sorted((e.get("profile") or {}).items()):
        body += f"\n\nProfile `{name}`:\n\n```text\n" + text.rstrip() + "\n```"
    return f"{body}\n\n_{_provenance_line(e)}; hardware/versions: {_env_line(e.get('env'))}._\n"


def render_md(record: dict) -> str:
    head = f"# {record['benchmark']}\n\n{record.get('description', '')}\n\n"
    if record.get("headline"):
        head += f"Headline: {record['headline']}.\n\n"
    if record.get("script"):
        head += f"Script: `{record['script']}`. "
    if "cells" not in record:
        return head + "\n\n" + _entry_md(record)
    cells = record["cells"]
    rows = [[f"[{c}](#{_anchor(c)})", hardware_of(e.get("env")), (e.get("commit") or "unknown")[:10], when(e)[:10]]
            for c, e in cells.items()]
    out = [head + f"{len(cells)} cells, one per variant; each section below is one run.\n",
           format_table(["cell", "hardware", "commit", "date"], rows)]
    out += [f"## {c}\n\n{_entry_md(e)}" for c, e in cells.items()]
    return "\n\n".join(out)


def _anchor(heading: str) -> str:
    keep = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return keep.replace(" ", "-")


def matmul_peak_tflops(device: str) -> float | None:
    """The measured bf16 matmul peak of this GPU (8192^3 products, best of 10 after 3 warm-ups), the denominator of
    MFU; None on a CPU (no MFU there)."""
    if not device.startswith("cuda"):
        return None
    import time

    import torch

    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for i in range(13):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x @ x
        torch.cuda.synchronize()
        if i >= 3:
            best = min(best, time.perf_counter() - t0)
    return 2 * 8192**3 / best / 1e12


def matmul_peak_tflops_in_child(device: str) -> float | None:
    """``matmul_peak_tflops`` measured in a child process: a driver whose workers own the GPU keeps no CUDA
    context or cached blocks of its own."""
    if not device.startswith("cuda"):
        return None
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            f"from common import matmul_peak_tflops; print(matmul_peak_tflops({device!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- MFU
#
# MFU = model FLOPs of one step / (step seconds x the measured bf16 matmul peak of the same GPU,
# ``matmul_peak_tflops``). Model FLOPs are the work the algorithm needs, counted one way everywhere:
#
# - a multiply-add is 2 FLOPs; matmuls (linear layers, the LM head, attention's QK^T and AV) are counted, elementwise
#   ops, norms, softmax and the sampler are not;
# - forward: every forward the algorithm runs (CFG: 2B rows when the batch is joint, a KL reference forward, a no-grad
#   pi_old or EMA pass), at the rows and positions it runs them;
# - backward: for each weight GEMM 1x its forward for the input gradient, plus 1x for the weight gradient only where
#   that weight is trained (full fine-tune: backward = 2x forward; LoRA: the frozen base weights' backward = 1x,
#   the adapters' rank-r GEMMs are small and fall out of analytic counts); attention's QK^T and AV take 2x (both
#   operands carry gradients). This is what autograd runs, so ``count_flops`` over a backward counts exactly it;
# - LM generation: prefill of the prompt plus one KV-cached decode step per new token (attention over the cache);
# - not counted: recomputation under gradient checkpointing, and our extra passes that are a choice rather than the
#   algorithm's work (the AR engine's exact-replay rescoring forward): MFU is model FLOPs, not hardware FLOPs.
#
# ``count_flops`` (torch's FlopCounterMode) counts what one run dispatches; on the ``meta`` device it costs no GPU
# time. Its attention formula counts the full T x T square even when causal (2x the causal work), so analytic counts
# (``lm_*_flops``) are preferred for LMs; ``tests/unit/test_benchmark_mfu.py`` checks the two agree up to that term.


def count_flops(fn, *args, **kwargs) -> int:
    """FLOPs ``fn(*args, **kwargs)`` dispatches (matmuls, convolutions, attention; torch's FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return counter.get_total_flops()


@contextlib.contextmanager
def without_recompute(module):
    """Gradient checkpointing off inside (diffusers' and transformers' ``gradient_checkpointing`` flags), back on
    after: a FLOP count of a backward excludes recomputation. Count at a small batch where memory needs the
    checkpointing, and scale (model FLOPs are linear in the rows)."""
    flagged = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in flagged:
            m.gradient_checkpointing = True


def mfu(flops: float | None, seconds: float, peak_tflops: float | None) -> float:
    """Model FLOPs utilization; nan without a peak (CPU) or a FLOP count."""
    if not flops or not peak_tflops or not seconds or seconds != seconds:
        return float("nan")
    return flops / (seconds * peak_tflops * 1e12)


def mfu_fields(flops: float | None, seconds: float, peak_tflops: float | None) -> dict:
    """The record's MFU fields: ``model_flops_per_step``, ``peak_tflops`` (None on CPU) and ``mfu`` (nan on CPU)."""
    return {"model_flops_per_step": flops, "peak_tflops": peak_tflops, "mfu": mfu(flops, seconds, peak_tflops)}


def fmt_mfu(value: float | None) -> str:
    """An MFU table cell: a percentage, ``-`` where there is none (CPU)."""
    return "-" if value is None or value != value else f"{value:.1%}"


def lm_dims(config) -> dict:
    """The FLOP-relevant sizes of a decoder-only transformer config (a transformers config or a dict of its fields)."""
    get = (lambda k, default=None: config.get(k, default)) if isinstance(config, dict) else (  # noqa: E731
        lambda k, default=None: getattr(config, k, default))
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or get("hidden_size") // heads
    return {"d": get("hidden_size"), "ff": get("intermediate_size"), "layers": get("num_hidden_layers"),
            "vocab": get("vocab_size"), "q": heads * head_dim,
            "kv": (get("num_key_value_heads") or heads) * head_dim}


def _lm_terms(config):
    c = lm_dims(config)
    d, q, kv, L = c["d"], c["q"], c["kv"], c["layers"]
    body = 2 * L * (d * q + 2 * d * kv + q * d + 3 * d * c["ff"])  # per token: projections and the gated MLP
    attn = lambda ctx: 4 * L * q * ctx  # per token: QK^T and AV over ``ctx`` keys  # noqa: E731
    return body, 2 * d * c["vocab"], attn


def lm_generate_flops(config, rows: int, prompt_len: int, new_tokens: int) -> float:
    """Generation of ``rows`` sequences: prefill of the prompt (causal), then one KV-cached decode step per new token
    (the body, the LM head, attention over the cache)."""
    body, head, attn = _lm_terms(config)
    p, r = prompt_len, new_tokens
    return rows * (p * (body + attn(p / 2)) + r * (body + head + attn(p + r / 2)))


def lm_replay_flops(config, rows: int, prompt_len: int, response_len: int, *, backward: str | None = "full") -> float:
    """A teacher-forced replay of ``rows`` sequences (prompt + response, causal, the LM head on response positions),
    with its backward: ``"full"`` (every weight trained: 2x), ``"lora"`` (frozen base weights: 1x for the matmuls,
    2x for attention) or None (a no-grad forward, e.g. pi_old or a KL reference)."""
    body, head, attn = _lm_terms(config)
    t, r = prompt_len + response_len, response_len
    matmul, attention = t * body + r * head, t * attn(t / 2)
    mult = {None: (1, 1), "full": (3, 3), "lora": (2, 3)}
    if backward not in mult:
        raise ValueError(f"backward={backward!r}: expected None, 'full' or 'lora'")
    m, a = mult[backward]
    return rows * (m * matmul + a * attention)
