"""The setup task preflights the run: a cluster recipe run locally with its placeholder bucket fails there,
naming checkpoint.root and the local-run fix, before any rollout/train task starts."""

from __future__ import annotations

import os

import pytest

from tasks.setup import setup_task


def test_placeholder_bucket_fails_in_setup_naming_checkpoint_root(monkeypatch):
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    with pytest.raises(Exception) as e:
        setup_task(recipe="sd35m-pickscore", overrides=[])
    msg = str(e.value)
    assert "checkpoint.root='s3://my-bucket/unirl/checkpoints'" in msg
    assert "checkpoint.root=runs" in msg and "NoCredentialsError" in msg


def test_tiny_recipe_passes_setup(tmp_path, run_name):
    out = setup_task(recipe="tiny-grpo", overrides=[f"checkpoint.root={tmp_path}", f"name={run_name}"])
    assert out.cfg.name == run_name
