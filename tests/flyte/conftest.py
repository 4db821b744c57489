"""Fixtures of the Flyte-side tests: tiny, short runs under a temporary checkpoint root."""

from __future__ import annotations

import uuid

import pytest

SMALL = {
    # 2 steps, small batches: the whole loop in seconds on one CPU core
    "tiny-flow-grpo": ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=4",
                       "diffusion.engine.forward_batch_size=4", "diffusion.sampling.num_steps=4"],
    "tiny-grpo": ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
                  "lm.engine.forward_batch_size=8"],
}


def tiny_overrides(recipe: str, root: str, name: str, *, steps: int = 2, chunk: int = 1) -> list[str]:
    """Overrides of a short run named ``name`` under ``root`` (a unique name keeps the local cache apart)."""
    return [*SMALL[recipe], f"loop.total_steps={steps}", f"loop.steps_per_chunk={chunk}",
            f"checkpoint.root={root}", f"name={name}"]


@pytest.fixture
def run_name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"
