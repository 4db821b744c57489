"""Preflight: an unwritable checkpoint root or an unreachable model fails in seconds, naming the field
(offline: no credentials, a closed port on 127.0.0.1, local paths)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from unirl_core.config import load_recipe
from unirl_core.config.preflight import check_models, preflight
from unirl_core.errors import ConfigError


@pytest.fixture
def no_aws(monkeypatch):
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    return monkeypatch


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is


def test_placeholder_s3_root_without_credentials_names_checkpoint_root(no_aws):
    cfg = load_recipe("sd35m-pickscore")
    assert cfg.checkpoint.root.startswith("s3://my-bucket/")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        preflight(cfg, timeout=10)
    msg = str(e.value)
    assert msg.startswith("checkpoint.root='s3://my-bucket/unirl/checkpoints'")
    assert "NoCredentialsError" in msg and "placeholder" in msg and "checkpoint.root=runs" in msg
    assert time.monotonic() - t0 < 10


def test_s3_root_at_a_closed_endpoint_names_checkpoint_root(no_aws):
    no_aws.setenv("AWS_ACCESS_KEY_ID", "x")
    no_aws.setenv("AWS_SECRET_ACCESS_KEY", "y")
    url = f"http://127.0.0.1:{_closed_port()}"
    cfg = load_recipe("tiny-grpo", ["checkpoint.root=s3://bogus-bucket/runs",
                                    f"checkpoint.storage_options={{client_kwargs: {{endpoint_url: '{url}'}}}}"])
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"^checkpoint.root='s3://bogus-bucket/runs'.*a bucket you can write"):
        preflight(cfg, timeout=8)
    assert time.monotonic() - t0 < 9


def test_unwritable_local_root(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        # as root permissions are not enforced: /proc refuses new entries to everyone
        target = "/proc/unirl-preflight" if os.access(ro, os.W_OK) else f"{ro}/runs"
        cfg = load_recipe("tiny-grpo", [f"checkpoint.root={target}"])
        with pytest.raises(ConfigError, match=r"^checkpoint.root=.*a directory this process can create and write"):
            preflight(cfg)
    finally:
        ro.chmod(0o700)


def test_a_root_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"^checkpoint.root="):
        preflight(load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path / 'f'}"]))


def test_writable_local_root_passes_and_leaves_nothing_of_the_run(tmp_path):
    root = tmp_path / "store"
    assert preflight(load_recipe("tiny-flow-grpo", [f"checkpoint.root={root}"])) == []
    # the run folder the probe created is removed again; the root folder stays: runs share it, and removing it
    # failed another run creating its own folder in it at the same moment (ENOENT)
    assert os.listdir(root) == []
    (root / "tiny-flow-grpo").mkdir(parents=True)
    assert preflight(load_recipe("tiny-flow-grpo", [f"checkpoint.root={root}"])) == []
    assert os.listdir(root / "tiny-flow-grpo") == []


def test_missing_local_model_dir_names_the_field(tmp_path):
    cfg = load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", "diffusion.model.source=/nonexistent/sd35"])
    with pytest.raises(ConfigError, match=r"^diffusion.model.source='/nonexistent/sd35'"):
        preflight(cfg)
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "lm.model.model=./models/missing-qwen"])
    with pytest.raises(ConfigError, match=r"^lm.model.model='./models/missing-qwen'"):
        preflight(cfg)
    (tmp_path / "m").mkdir()
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", f"lm.model.model={tmp_path / 'm'}"])
    assert preflight(cfg) == []


def test_hub_ids_offline(tmp_path, monkeypatch):
    cfg = load_recipe("qwen3-math", [f"checkpoint.root={tmp_path}"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    with pytest.raises(ConfigError, match=r"^lm.model.model='Qwen/.*in the local cache, since HF_HUB_OFFLINE"):
        check_models(cfg)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    notes = check_models(cfg, network=False)
    assert len(notes) == 1 and notes[0].startswith("lm.model.model=") and "skipped" in notes[0]


def test_unreachable_hub_names_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", os.environ["HF_ENDPOINT"])
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    cfg = load_recipe("sd35m-ocr", [f"checkpoint.root={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^diffusion.model.source='stabilityai/.*reachable hub model"):
        check_models(cfg, timeout=8)


def test_run_local_preflights_before_building_anything(tmp_path, monkeypatch):
    """The library loop runs the setup task's preflight first: a cluster recipe run locally as shipped names its
    placeholder checkpoint root instead of failing with the storage library's credentials error."""
    from unirl_core.loop import local

    built = []
    monkeypatch.setattr(local, "init_run", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError, match=r"^checkpoint.root='s3://my-bucket/"):
        local.run_local(load_recipe("sd35m-pickscore"), progress=False)
    assert built == []


def test_a_vllm_run_without_vllm_names_the_install_script(tmp_path):
    """The run would start its server with an interpreter that has no vLLM (this test's own: the main venv has
    none): refused before anything is built, naming lm.vllm.python and scripts/install_vllm.sh."""
    import importlib.util
    import sys

    assert importlib.util.find_spec("vllm") is None  # the project's venv never has vLLM (it lives in .venv-vllm)
    cfg = load_recipe("tiny-grpo-vllm", [f"checkpoint.root={tmp_path}", f"lm.vllm.python={sys.executable}"])
    with pytest.raises(ConfigError, match=r"lm\.vllm\.python=.*expected an interpreter with vLLM installed.*"
                                          r"scripts/install_vllm\.sh"):
        preflight(cfg, timeout=30)
    attached = load_recipe("tiny-grpo-vllm", [f"checkpoint.root={tmp_path}", f"lm.vllm.python={sys.executable}",
                                              "lm.vllm.base_url=http://127.0.0.1:9"])
    preflight(attached, timeout=30)  # a server the run attaches to is not started here: no interpreter needed


def test_a_missing_sft_export_names_the_sft_command(tmp_path):
    """toy-sums starts from the export of SFT run sft-toy-sums: before that run, the refusal names its command."""
    cfg = load_recipe("toy-sums", [f"checkpoint.root={tmp_path}", f"lm.model.model={tmp_path}/sft-toy-sums/export"])
    with pytest.raises(ConfigError, match=r"lm\.model\.model=.*export of SFT run 'sft-toy-sums'.*"
                                          r"python -m unirl_core\.sft --recipe sft-toy-sums"):
        preflight(cfg, timeout=30)
