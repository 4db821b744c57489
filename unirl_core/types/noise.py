"""NoiseRecipe: the driver-authored description of a rollout's initial noise.

Only the fields live here; ``unirl_core.sde.noise`` turns a recipe into bit-identical x_T tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from unirl_core.errors import ConfigError, field_error


@dataclass(frozen=True, kw_only=True)
class NoiseRecipe:
    """Seeds for the initial latents of one rollout step."""

    base_seed: int
    """Run-level seed; combined with each group id by a stable hash into a per-group seed."""
    same_noise_per_group: bool = False
    """Give every sibling of a group the same x_T (siblings then differ only through SDE noise)."""

    def __post_init__(self) -> None:
        if not isinstance(self.base_seed, int) or self.base_seed < 0 or self.base_seed >= 2**63:
            raise field_error(ConfigError, "noise.base_seed", self.base_seed, "an integer in [0, 2**63)",
                              "use a non-negative run seed, e.g. 0")
