"""SFT in plain Python: the phase functions the Flyte tasks call, chained in this process."""

from __future__ import annotations

import json
import time

import fsspec

from unirl_core.loop.local import say
from unirl_core.report.tensorboard import ScalarLog
from unirl_core.sft.config import SFTConfig
from unirl_core.sft.phases import export_model, init_sft, publish_sft, train_chunk

METRICS_FILE = "sft_metrics.jsonl"
"""One JSON line of metrics per step, appended under ``<root>/<run>/``."""


def sft_progress_line(step: int, total: int, metrics: dict, eta_seconds: float) -> str:
    """``sft step k/N | loss | grad norm | step time | ETA``."""
    return (f"sft step {step}/{total} | loss {metrics['sft/loss']:.4f} | grad {metrics['sft/grad_norm']:.3f} | "
            f"step {metrics['time/step']:.2f}s | ETA {eta_seconds:.0f}s")


class StepLog:
    """Per-step output of a chunk: the metrics file, TensorBoard scalars, a progress line every ``log_every``."""

    def __init__(self, cfg: SFTConfig, *, show: bool) -> None:
        self.cfg, self.show = cfg, show
        run = f"{cfg.checkpoint.root.rstrip('/')}/{cfg.name}"
        self.metrics_uri = f"{run}/{METRICS_FILE}"
        self.scalars = ScalarLog(run, storage_options=cfg.checkpoint.storage_options)
        self.lines: list[str] = []
        self._t0, self._first = time.perf_counter(), None
        self._pending: list[dict] = []

    def __call__(self, step: int, metrics: dict) -> None:
        self._first = step if self._first is None else self._first
        self.scalars.log(step, metrics)
        self._pending.append(metrics)
        total = self.cfg.loop.total_steps
        if step % self.cfg.loop.log_every == 0 or step == total:
            eta = (time.perf_counter() - self._t0) / (step - self._first + 1) * (total - step)
            self.lines.append(sft_progress_line(step, total, metrics, eta))
            say(self.lines[-1], self.show)

    def close(self) -> None:
        """Append the buffered metrics lines and flush the scalars."""
        if self._pending:
            fs, path = fsspec.core.url_to_fs(self.metrics_uri, **self.cfg.checkpoint.storage_options)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            old = fs.cat_file(path).decode() if fs.exists(path) else ""
            with fs.open(path, "w") as f:
                f.write(old + "".join(json.dumps(m, sort_keys=True) + "\n" for m in self._pending))
            self._pending = []
        self.scalars.close()


def run_sft(cfg: SFTConfig, *, resume_from: str = "latest", export: bool = True,
            progress: bool = True) -> list[dict]:
    """Train ``cfg`` to ``loop.total_steps`` (from the published version, or a fresh step 0), publishing a
    version at the end of every chunk; with ``export`` the final version is exported to ``<root>/<run>/export``
    for the RL loop. Returns the metrics of every step trained in this call."""
    ckpt = init_sft(cfg, resume_from=resume_from)
    steps = StepLog(cfg, show=progress)
    history: list[dict] = []
    try:
        while ckpt.step < cfg.loop.total_steps:
            ckpt, chunk = train_chunk(cfg, ckpt, on_step=steps)
            publish_sft(cfg, ckpt)
            history.extend(chunk)
    finally:
        steps.close()
    if export:
        export_model(cfg, ckpt)
    return history
