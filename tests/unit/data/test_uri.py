"""Prompt sets by URI (unirl_core/data/uri.py) and their preflight check: a local file, a real HTTP server, a missing,
empty, malformed or foreign file, a missing column, a hub dataset id that cannot be reached. Every error names the
field, the URI and what was found."""

from __future__ import annotations

import functools
import http.server
import json
import threading
from pathlib import Path

import pytest

from unirl_core.config import load_recipe
from unirl_core.config.preflight import check_prompt_data
from unirl_core.data import PromptDataConfig, load_prompts
from unirl_core.data import uri as uri_mod
from unirl_core.errors import ConfigError

ROWS = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(8)]


def write_jsonl(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg_for(path: str, *extra: str):
    return load_recipe("tiny-grpo", ["data.source=file", f"data.file={{path: '{path}'}}", "data.prompts_per_step=4",
                                     *extra])


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_root(tmp_path):
    """A real HTTP server (python's http.server) on 127.0.0.1 serving ``tmp_path / 'www'``."""
    www = tmp_path / "www"
    www.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(www)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_local_file_passes_preflight_and_loads(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl")
    check_prompt_data(cfg_for(str(path)))
    ds = load_prompts(PromptDataConfig(path=str(path)))
    assert [r.prompt for r in ds.records] == [r["prompt"] for r in ROWS] and ds.records[3].targets == {"answer": "6"}


def test_missing_file_names_the_field_the_uri_and_what_was_found(tmp_path):
    missing = str(tmp_path / "data" / "pickscore" / "train.jsonl")
    with pytest.raises(ConfigError) as info:
        check_prompt_data(cfg_for(missing))
    msg = str(info.value)
    assert msg.startswith("data.file.path=") and missing in msg and "missing file" in msg
    with pytest.raises(ConfigError, match="missing file"):  # the run's own read says the same
        load_prompts(PromptDataConfig(path=missing))


def test_jsonl_over_http_from_a_real_server(http_root):
    www, base = http_root
    write_jsonl(www / "train.jsonl")
    url = f"{base}/train.jsonl"
    check_prompt_data(cfg_for(url))
    assert [r.prompt for r in load_prompts(PromptDataConfig(path=url)).records] == [r["prompt"] for r in ROWS]
    with pytest.raises(ConfigError, match=r"data\.file\.path=.*/nope\.jsonl.*missing file"):
        check_prompt_data(cfg_for(f"{base}/nope.jsonl"))


def test_malformed_empty_and_foreign_files(tmp_path, http_root):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{\"prompt\": \"unterminated\n")
    with pytest.raises(ConfigError, match=r"data\.file\.path=.*bad\.jsonl.*malformed JSON at line 2"):
        check_prompt_data(cfg_for(str(bad)))
    www, base = http_root
    (www / "bad.jsonl").write_bytes(bad.read_bytes())
    with pytest.raises(ConfigError, match="malformed JSON at line 2"):
        load_prompts(PromptDataConfig(path=f"{base}/bad.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"empty\.jsonl.*found: an empty file"):
        check_prompt_data(cfg_for(str(empty)))
    csv = tmp_path / "train.csv"
    csv.write_text("prompt\na cat\n")
    with pytest.raises(ConfigError, match=r"train\.csv.*found: a file with suffix '\.csv'"):
        check_prompt_data(cfg_for(str(csv)))
    not_objects = tmp_path / "list.jsonl"
    not_objects.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match="row 0 is a JSON list, not an object"):
        check_prompt_data(cfg_for(str(not_objects)))
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(ConfigError, match="not parquet"):
        check_prompt_data(cfg_for(str(fake)))


def test_a_missing_column_and_too_few_prompts_are_caught_at_setup(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1 + 1 =", "answer": "2"}] * 8)
    with pytest.raises(ConfigError, match=r"data\.file\.prompt_field='prompt'.*columns \['answer', 'question'\]"):
        check_prompt_data(cfg_for(str(path)))
    check_prompt_data(cfg_for(str(path), "data.file.prompt_field=question"))
    few = write_jsonl(tmp_path / "few.jsonl", ROWS[:2])
    with pytest.raises(ConfigError, match=r"data\.prompts_per_step"):
        check_prompt_data(cfg_for(str(few)))


def test_a_large_file_is_probed_by_its_head_only(tmp_path, monkeypatch):
    monkeypatch.setattr(uri_mod, "PROBE_BYTES", 100)
    path = write_jsonl(tmp_path / "big.jsonl", ROWS * 4)
    rows, whole = uri_mod.probe_rows(uri_mod.Where("data.file.path", str(path)))
    assert not whole and 0 < len(rows) < len(ROWS) * 4 and rows[0] == ROWS[0]
    with path.open("a") as f:  # a bad line past the head: the preflight does not read it, the run's read does
        f.write("{oops\n")
    check_prompt_data(cfg_for(str(path)))
    with pytest.raises(ConfigError, match="malformed JSON at line 33"):
        load_prompts(PromptDataConfig(path=str(path)))


def test_hub_dataset_id_goes_through_datasets_and_says_what_failed(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    # no network in tests: offline mode, also where huggingface_hub / datasets read it at import already
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    assert uri_mod.hub_dataset_id("hf://datasets/org/name") == "org/name"
    assert uri_mod.hub_dataset_id("hf://datasets/org/name/train.jsonl") is None  # a file in the repo: fsspec
    with pytest.raises(ConfigError, match=r"data\.file\.path='hf://datasets/someorg/no-such-prompts'.*"
                                          r"hub dataset 'someorg/no-such-prompts' split 'train'"):
        check_prompt_data(cfg_for("hf://datasets/someorg/no-such-prompts"))
