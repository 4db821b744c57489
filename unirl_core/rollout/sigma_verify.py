"""sigma_verify: the driver's check that an engine used the pinned sigma schedule.

Engines echo the sigmas they fed to each step into ``DiffusionSegment.sigmas``. A schedule that an
engine recomputed (shift applied twice, another step count), truncated, rounded to bf16, or
reported as timesteps (sigma x 1000) changes the transition kernels, and with them every replayed
log-prob: Flow-GRPO would optimise the wrong ratio without any visible error. So this fails closed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from unirl_core.errors import NumericsError, field_error
from unirl_core.types import DiffusionSamplingParams, DiffusionSegment, SampleBatch

DEFAULT_ATOL = 1e-6
"""Pinned and echoed values are both float32 copies of one schedule: anything above float noise is a bug."""


def sigma_verify(pinned: Sequence[float] | Tensor, echoed: Sequence[float] | Tensor | None, *,
                 atol: float = DEFAULT_ATOL, where: str = "segment.sigmas") -> None:
    """Raise ``NumericsError`` unless ``echoed`` equals ``pinned`` within ``atol`` element-wise."""
    want = torch.as_tensor(pinned, dtype=torch.float64).flatten().cpu()
    if echoed is None:
        raise field_error(NumericsError, where, None, f"the {want.numel()} sigmas the engine used",
                          "the engine must echo the schedule it used; an engine that cannot is not trainside-exact")
    got = torch.as_tensor(echoed).detach().to(torch.float64).flatten().cpu()
    if got.numel() != want.numel():
        raise field_error(NumericsError, where, _short(got), f"{want.numel()} values (num_steps + 1) like the pinned "
                          f"{_short(want)}", "the engine ran another step count or dropped the final sigma (truncated)")
    if not bool(torch.isfinite(got).all()):
        raise field_error(NumericsError, where, _short(got), "finite values", "check the engine's schedule handling")
    if bool(torch.isclose(got, want, rtol=0.0, atol=atol).all()):
        return
    if float(got.max()) > 1.5 and float(want.max()) <= 1.0:
        ratio = float(got.max()) / max(float(want.max()), 1e-12)
        raise field_error(NumericsError, where, _short(got),
                          f"sigmas in [0, 1] matching {_short(want)}",
                          f"the echo looks like timesteps (x{ratio:.0f} scale, e.g. sigma * 1000): echo sigmas, "
                          "not scheduler.timesteps")
    diff = (got - want).abs()
    k = int(diff.argmax())
    raise field_error(NumericsError, where, _short(got),
                      f"the pinned schedule {_short(want)} within atol={atol}",
                      f"step {k} differs by {float(diff[k]):.3g} (pinned {float(want[k]):.9g}, echoed {float(got[k]):.9g});"
                      " the engine recomputed, re-shifted or rounded (e.g. to bf16) the schedule instead of using it verbatim")


def verify_batch_sigmas(batch: SampleBatch, *, atol: float = DEFAULT_ATOL) -> None:
    """``sigma_verify`` every generated diffusion Part of a filled batch against its own pinned params."""
    for s in batch.samples:
        part = s.generated
        if part.kind != "diffusion":
            continue
        if not isinstance(part.sampling, DiffusionSamplingParams):
            raise field_error(NumericsError, f"sample[{s.sample_id}].sampling", type(part.sampling).__name__,
                              "pinned DiffusionSamplingParams", "pin the schedule before rollout")
        seg = part.segment
        echoed = seg.sigmas if isinstance(seg, DiffusionSegment) else None
        sigma_verify(part.sampling.sigmas, echoed, atol=atol, where=f"sample[{s.sample_id}].segment.sigmas")


def _short(t: Tensor) -> str:
    vals = [f"{v:.6g}" for v in t.tolist()]
    return "[" + ", ".join(vals if len(vals) <= 6 else vals[:3] + ["..."] + vals[-2:]) + "]"


def verify_replay_schedule(batch: SampleBatch, schedule: Sequence[float]) -> None:
    """Before a trainer replays ``batch``: every diffusion Part's pinned schedule and the engine's echo must equal
    ``schedule`` - the one the trainer derives anew from the run's config - bit for bit. Rollout checked the echo
    against the pin within float noise; a Part changed after that (an edited or damaged artifact, a projection
    rebuilt by other code) would replay other transition kernels and train silently on a wrong ratio."""
    want32 = torch.tensor(list(schedule), dtype=torch.float32)  # pins are float32 values (DiffusionSamplingParams)
    want = want32.to(torch.float64)
    for s in batch.samples:
        part = s.generated
        if part.kind != "diffusion":
            continue
        pinned = torch.tensor(list(part.sampling.sigmas), dtype=torch.float64)
        if pinned.shape != want.shape or not torch.equal(pinned, want):
            raise field_error(NumericsError, f"sample[{s.sample_id}].sampling.sigmas", _short(pinned),
                              f"the run's schedule {_short(want)} bit for bit",
                              "the Part was pinned by another config (num_steps, shift, schedule, size) or changed "
                              "after rollout; sample it again with this run's config")
        seg = part.segment
        echoed = seg.sigmas.detach().cpu() if isinstance(seg, DiffusionSegment) and seg.sigmas is not None else None
        if echoed is None or echoed.shape != want32.shape or not torch.equal(echoed.to(torch.float32), want32):
            shown = "missing" if echoed is None else _short(echoed.to(torch.float64))
            raise field_error(NumericsError, f"sample[{s.sample_id}].segment.sigmas", shown,
                              f"the schedule the trainer derives from the run's config, {_short(want)}, bit for bit",
                              "the trajectory's echo changed after rollout (an edited or damaged artifact?); sample "
                              "the step again: replaying other sigmas trains on a wrong ratio")
