"""Sampling parameters pinned on a generated Part.

The diffusion sigma schedule lives here and nowhere else: engines consume it verbatim and echo
what they used (see ``unirl_core.rollout.sigma_verify``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from unirl_core.errors import ConfigError, check_ints, field_error

SDEType = Literal["flow", "dance", "cps", "cps_gaussian", "ode"]
SDE_TYPES: tuple[str, ...] = ("flow", "dance", "cps", "cps_gaussian", "ode")
"""Kernel names. ``cps`` and ``cps_gaussian`` sample the same CPS transition and differ only in the step
log-prob: ``cps`` uses the public Flow-GRPO code's convention (``-(x' - mean)^2`` averaged, constants and the
``1 / (2 std^2)`` scale dropped), ``cps_gaussian`` the full Gaussian log-density (see ``unirl_core.sde``)."""


def as_float32_tuple(values) -> tuple[float, ...]:
    """Round values to float32 and return them as Python floats (exact float32 values)."""
    return tuple(float(v) for v in np.asarray(values, dtype=np.float32).reshape(-1))


@dataclass(frozen=True, kw_only=True)
class DiffusionSamplingParams:
    """How one diffusion Part is sampled. Frozen: a Part's schedule never changes after pinning."""

    sigmas: tuple[float, ...]
    """Pinned sigma schedule, ``num_steps + 1`` float32 values, strictly decreasing, ending at 0."""
    sde_type: SDEType = "flow"
    """Per-step kernel: ``flow`` (Flow-GRPO), ``dance`` (DanceGRPO), ``cps`` (coefficients-preserving, log-prob as
    in the Flow-GRPO code), ``cps_gaussian`` (the same transition, full Gaussian log-prob), ``ode``."""
    noise_level: float = 0.7
    """Flow-GRPO ``a`` / DanceGRPO ``eta`` / CPS noise level; 0 makes every step deterministic."""
    sde_window_size: int | None = None
    """Number of consecutive SDE steps (Flow-GRPO-Fast); ``None`` makes every step an SDE step."""
    sde_window_range: tuple[int, int] | None = None
    """Half-open step range ``[lo, hi)`` the window start is drawn from; ``None`` means the whole schedule."""
    guidance_scale: float = 4.5
    """Classifier-free guidance scale; 1.0 disables the unconditional branch."""
    negative_prompt: str = ""
    """Prompt used for the unconditional CFG branch."""
    height: int = 64
    """Image height in pixels (a multiple of the VAE scale factor times the patch size)."""
    width: int = 64
    """Image width in pixels."""

    def __post_init__(self) -> None:
        sig = self.sigmas
        if not isinstance(sig, tuple):
            object.__setattr__(self, "sigmas", as_float32_tuple(sig))
            sig = self.sigmas
        if len(sig) < 2:
            raise field_error(ConfigError, "sampling.sigmas", sig, "at least 2 values (num_steps + 1)",
                              "build the schedule with unirl_core.sde.flow_sigmas(num_steps=...)")
        if any(not math.isfinite(s) for s in sig):
            raise field_error(ConfigError, "sampling.sigmas", sig, "finite values", "rebuild the schedule")
        if as_float32_tuple(sig) != sig:
            raise field_error(ConfigError, "sampling.sigmas", sig, "float32-representable values",
                              "pin the schedule with as_float32_tuple(...) so every engine sees the same bits")
        if any(b >= a for a, b in zip(sig, sig[1:])) or sig[-1] < 0:
            raise field_error(ConfigError, "sampling.sigmas", sig, "strictly decreasing values >= 0",
                              "check the shift / num_steps used to build the schedule")
        if self.sde_type not in SDE_TYPES:
            raise field_error(ConfigError, "sampling.sde_type", self.sde_type, f"one of {SDE_TYPES}",
                              "pick a supported SDE kernel")
        if not (self.noise_level >= 0 and math.isfinite(self.noise_level)):
            raise field_error(ConfigError, "sampling.noise_level", self.noise_level, "a finite value >= 0",
                              "use e.g. 0.7 for Flow-GRPO")
        steps = self.num_steps
        if self.sde_window_size is not None and not (1 <= self.sde_window_size <= steps):
            raise field_error(ConfigError, "sampling.sde_window_size", self.sde_window_size,
                              f"an integer in [1, num_steps={steps}] or None", "shrink the window or add steps")
        if self.sde_window_range is not None:
            lo, hi = self.sde_window_range
            size = self.sde_window_size or 1
            if not (0 <= lo < hi <= steps and hi - lo >= 1 and lo + size <= steps):
                raise field_error(ConfigError, "sampling.sde_window_range", self.sde_window_range,
                                  f"0 <= lo < hi <= num_steps={steps} with room for the window",
                                  "set a range inside the schedule, e.g. (0, num_steps // 2)")
        for name in ("height", "width"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0 and v % 8 == 0):
                raise field_error(ConfigError, f"sampling.{name}", v, "a positive multiple of 8",
                                  "use a size like 64, 512 or 1024")
        if not (self.guidance_scale >= 0 and math.isfinite(self.guidance_scale)):
            raise field_error(ConfigError, "sampling.guidance_scale", self.guidance_scale, "a finite value >= 0",
                              "use 1.0 to disable CFG")

    @property
    def num_steps(self) -> int:
        """Number of denoising steps T (``len(sigmas) - 1``)."""
        return len(self.sigmas) - 1


@dataclass(frozen=True, kw_only=True)
class ARSamplingParams:
    """How one autoregressive Part is sampled. Log-probs are taken under the temperature-scaled distribution."""

    temperature: float = 1.0
    """Softmax temperature (> 0); the recorded log-probs are of logits / temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1.0 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables it."""
    max_new_tokens: int = 64
    """Upper bound on generated tokens; hitting it gives finish reason ``length``."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Stop strings; the response is cut after the first match and ends with reason ``stop``."""
    seed: int | None = None
    """Sampling seed; None draws from the engine's generator."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise field_error(ConfigError, "sampling.temperature", self.temperature, "a finite value > 0",
                              "log-probs are undefined at temperature 0; use e.g. 1.0 (greedy eval: top_k=1)")
        if not (0 < self.top_p <= 1):
            raise field_error(ConfigError, "sampling.top_p", self.top_p, "a value in (0, 1]", "use 1.0 to disable")
        check_ints("sampling", self, ("top_k",), "use 0 to disable", minimum=0)
        check_ints("sampling", self, ("max_new_tokens",), "set the completion budget, e.g. 256")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise field_error(ConfigError, "sampling.stop", self.stop, "non-empty strings", "drop empty stop strings")


SamplingParams = DiffusionSamplingParams | ARSamplingParams
