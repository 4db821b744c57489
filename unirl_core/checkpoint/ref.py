"""CheckpointRef: the small value tasks pass around to name one published checkpoint version."""

from __future__ import annotations

from dataclasses import dataclass

from unirl_core.errors import CheckpointError, field_error

STEP_PREFIX = "step-"
STEP_DIGITS = 8


def step_dirname(step: int) -> str:
    """``step-00000012`` for step 12 (zero-padded so names sort in step order)."""
    if not (isinstance(step, int) and 0 <= step < 10**STEP_DIGITS):
        raise field_error(CheckpointError, "step", step, f"an integer in [0, 1e{STEP_DIGITS})",
                          "checkpoint steps count rollout batches from 0")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a ``step-XXXXXXXX`` folder name, or None for any other name."""
    digits = name[len(STEP_PREFIX):]
    if name.startswith(STEP_PREFIX) and len(digits) == STEP_DIGITS and digits.isdigit():
        return int(digits)
    return None


@dataclass(frozen=True, kw_only=True)
class CheckpointRef:
    """One complete (manifest-bearing) checkpoint version."""

    uri: str
    """URL of the version folder: ``/abs/dir/<run>/step-00000012`` or ``s3://bucket/prefix/<run>/step-00000012``."""
    run: str
    """Run name (the folder between the store root and the version folders)."""
    step: int
    """Training step the version was written after."""
    policy_version: int
    """Version of the policy weights in it (what rollouts record as ``Part.policy_version``)."""
