"""Review finding: a fork started while its parent's retention runs can be left referencing deleted files.

``CheckpointStore.save_reference`` pins the parent's version, re-reads its manifest and writes the fork's; the
parent's ``apply_retention`` reads the pins once and then deletes. A fork whose pin lands after that read (and whose
re-check runs before the delete) passes every check and is broken a moment later: nothing ties the two together."""

from __future__ import annotations

import pytest
import torch

from unirl_core.checkpoint import CheckpointStore, load_weights
from unirl_core.errors import CheckpointError


def _save(store, step):
    return store.save(step, weights={"w": torch.full((4,), float(step))}, policy_version=step,
                      train_state={"counters": {"step": step}}, config={"c": 1}, extra={}, publish=False)


def test_a_fork_pinned_between_retentions_read_and_delete_keeps_its_parents_files(tmp_path, monkeypatch):
    parent = CheckpointStore(str(tmp_path), "p", keep_last=1)
    v1 = _save(parent, 1)
    _save(parent, 2)
    fork = CheckpointStore(str(tmp_path), "f")
    read_pins = CheckpointStore.pinned_steps
    started = []

    def pins_then_a_fork_starts(self):
        pins = read_pins(self)
        if self.run == "p" and not started:  # the fork runs in another process right after the parent's read
            started.append(fork.save_reference(v1, config={"c": 2}, extra={}))
        return pins

    monkeypatch.setattr(CheckpointStore, "pinned_steps", pins_then_a_fork_starts)
    try:
        parent.publish(parent.ref_for(2, 2))  # retention: keep_last=1 dooms version 1
    except CheckpointError:
        pytest.fail("retention refused to run")
    assert started, "the fork started"
    # the fork's start version passed save_reference's re-check; its weights must still read
    load_weights(started[0])


def test_an_unpublished_version_is_not_forked(tmp_path):
    # Review finding: version 2 written but never published (a crash before publish) is replaced when the parent
    # resumes from its published version 1 (resume.check_no_newer's leftover case; train_step saves with
    # overwrite=True), which would break a fork that references it. A fork must start from a published version.
    parent = CheckpointStore(str(tmp_path), "p", keep_last=5)
    v1 = _save(parent, 1)
    parent.publish(v1)
    v2 = _save(parent, 2)  # never published
    with pytest.raises(CheckpointError, match=r"checkpoint.fork_from.*step-00000002.*published"):
        CheckpointStore(str(tmp_path), "f").save_reference(v2, config={}, extra={})
    assert not (tmp_path / "p" / "forks").exists() and not (tmp_path / "f").exists()
