"""The trainer stays resident when its version's background write finished before the step asked to publish it:
the writer's own publish then waits for the write, and the next rollout (loop.rollout_with_trainer) must still find
the trainer at that version instead of restoring it from the store - which, between full states
(checkpoint.every_n_steps > 1), holds weights only and cannot be restored (a race seen under CI load)."""

from __future__ import annotations

import torch

from unirl_core.checkpoint import writer as writer_mod
from unirl_core.config import load_recipe
from unirl_core.loop.executors import in_process
from unirl_core.loop.local import run_local


def test_a_write_finished_before_its_publish_keeps_the_trainer_resident(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    original = writer_mod._Write.request_publish

    def finished_first(self):  # the write wins the race: done before the publish is asked for
        self.done.wait()
        return original(self)

    monkeypatch.setattr(writer_mod._Write, "request_publish", finished_first)
    ex = in_process()
    ex.finish_writes()
    ex.resident.clear()
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=5", "report.progress=false",
                                    "checkpoint.every_n_steps=3", "data.prompts_per_step=2",
                                    "data.samples_per_prompt=4", "train.micro_batch_size=8",
                                    "lm.engine.forward_batch_size=8"])
    history = run_local(cfg)  # step 5 trains from version 4, written weights-only
    assert len(history) == 5
    assert [m.get("rollout/with_trainer") for m in history] == [1.0] * 5
    assert [m.get("rollout/trainer_restored") for m in history][1:] == [0.0] * 4
