"""Replay through Flyte: a grpo workflow run of each tiny family (diffusion, LM, agentic, composed) that keeps its
batches replays three steps bitwise through the replay workflow (flytekit local execution), and a changed stored
reward fails the workflow naming the field."""

from __future__ import annotations

import pytest

from tests.flyte.conftest import tiny_overrides
from unirl_core.checkpoint.batches import BatchStore
from workflows.grpo import grpo
from workflows.replay import replay

KEEP = ["checkpoint.keep_batches=true", "checkpoint.keep_every=1"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny-flow-grpo", "tiny-grpo", "tiny-agent-calc"])
def test_replay_workflow_rebuilds_three_steps_of_a_workflow_run(tmp_path, run_name, recipe):
    if recipe == "tiny-agent-calc":  # the agentic workflow test's small batches, tiny-grpo's run settings
        from tests.flyte.test_agent_workflow import AGENT

        overrides = [*AGENT, *tiny_overrides("tiny-grpo", str(tmp_path), run_name, steps=3)[4:]]
    else:
        overrides = tiny_overrides(recipe, str(tmp_path), run_name, steps=3)
    grpo(recipe=recipe, overrides=overrides + KEEP)
    assert BatchStore(str(tmp_path), run_name).steps() == [1, 2, 3]
    out = replay(run=str(tmp_path / run_name), steps=[1, 2, 3])
    assert out["replay/steps"] == 3.0
    store = BatchStore(str(tmp_path), run_name)
    batch = store.load(2)
    batch.samples[1].parts[-1].reward += 1.0
    store.save(2, batch)
    with pytest.raises(Exception, match="field 'reward'"):
        replay(run=str(tmp_path / run_name), steps=[2])


@pytest.mark.slow
def test_replay_workflow_rebuilds_a_composed_workflow_run(tmp_path):
    from tests.unit.compose.conftest import small_overrides
    from workflows.enhance import enhance

    overrides = small_overrides(tmp_path, "loop.steps_per_chunk=1", "loop.total_steps=3", *KEEP)
    enhance(recipe="shapes-enhance", overrides=overrides)
    out = replay(run=str(tmp_path / "enh"), steps=[1, 2, 3])
    assert out["replay/steps"] == 3.0
