"""How a diffusion run's per-step sampling params are built: the pinned schedule, SDE kernel, window and CFG."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from unirl_core.errors import ConfigError, field_error
from unirl_core.sde.schedules import flow_sigmas, flux_sigmas
from unirl_core.sde.window import sliding_window_start
from unirl_core.types import DiffusionSamplingParams, SDEType

ScheduleKind = Literal["auto", "sd3", "flux"]


@dataclass(frozen=True, kw_only=True)
class DiffusionSamplingConfig:
    """How each step's DiffusionSamplingParams are built (the schedule is computed once and pinned)."""

    num_steps: int = 10
    """Denoising steps T."""
    schedule: ScheduleKind = "auto"
    """Sigma schedule: ``sd3`` (static ``shift``, the SD3 pipeline's), ``flux`` (dynamic shift from the image
    sequence length ``(height // 16) * (width // 16)``, the Flux pipeline's), or ``auto``: the model family's own."""
    shift: float = 3.0
    """Static SD3 timestep shift of the flow-matching schedule (``schedule: sd3``; unused by ``flux``)."""
    sde_type: SDEType = "flow"
    """SDE kernel: flow (Flow-GRPO), dance (DanceGRPO), cps, ode."""
    noise_level: float = 0.7
    """Kernel noise level (Flow-GRPO a / DanceGRPO eta)."""
    sde_window_size: int | None = None
    """Flow-GRPO-Fast window of SDE steps; None = every step."""
    sde_window_range: tuple[int, int] | None = None
    """Range the window start is drawn from; None = the whole schedule."""
    sde_window_shift_interval: int | None = None
    """MixGRPO's progressive sliding window: the ``sde_window_size`` window starts at the first denoising step
    and moves ``sde_window_stride`` steps towards the clean end every this many training steps, then stays at
    the end (``unirl_core.sde.window.sliding_window_start``). Replaces the random start of ``sde_window_range``
    (leave that unset). None: no schedule."""
    sde_window_stride: int = 1
    """Steps the sliding window moves per ``sde_window_shift_interval`` (MixGRPO's stride)."""
    guidance_scale: float = 4.5
    """Classifier-free guidance scale (1.0 = off)."""
    negative_prompt: str = ""
    """Negative prompt of the unconditional branch."""
    height: int = 64
    """Image height in pixels."""
    width: int = 64
    """Image width in pixels."""
    same_noise_per_group: bool = False
    """Start all siblings of a group from the same x_T."""

    def __post_init__(self) -> None:
        if self.sde_window_shift_interval is None:
            return
        if self.sde_window_size is None or self.sde_window_range is not None:
            raise field_error(ConfigError, "diffusion.sampling.sde_window_shift_interval", self.sde_window_shift_interval,
                              "a set sde_window_size and no sde_window_range",
                              "the sliding window needs its size and decides its own start; set sde_window_size, "
                              "remove sde_window_range")
        sliding_window_start(1, num_steps=self.num_steps, size=self.sde_window_size,
                             shift_interval=self.sde_window_shift_interval, stride=self.sde_window_stride)

    def window_range(self, step: int | None) -> tuple[int, int] | None:
        """The ``sde_window_range`` of training step ``step``: the sliding window's one start, else as configured."""
        if self.sde_window_shift_interval is None or step is None:
            return self.sde_window_range
        start = sliding_window_start(step, num_steps=self.num_steps, size=self.sde_window_size,
                                     shift_interval=self.sde_window_shift_interval, stride=self.sde_window_stride)
        return (start, start + 1)

    def sigmas(self, family: str) -> tuple[float, ...]:
        """The pinned ``[T+1]`` schedule for a model of ``family`` (``sd3`` / ``flux``)."""
        kind = family if self.schedule == "auto" else self.schedule
        if kind == "flux":
            # Flux packs 2x2 latent patches of a VAE with 8x downsampling: one token per 16x16 pixels.
            return flux_sigmas(num_steps=self.num_steps, image_seq_len=(self.height // 16) * (self.width // 16))
        return flow_sigmas(num_steps=self.num_steps, shift=self.shift)

    def params(self, family: str = "sd3", step: int | None = None) -> DiffusionSamplingParams:
        """The DiffusionSamplingParams every Part of step ``step`` is pinned to, for a model of ``family``
        (``step`` places the sliding window; None: its first position)."""
        return DiffusionSamplingParams(
            sigmas=self.sigmas(family), sde_type=self.sde_type,
            noise_level=self.noise_level, sde_window_size=self.sde_window_size,
            sde_window_range=self.window_range(1 if step is None else step), guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt, height=self.height, width=self.width)
