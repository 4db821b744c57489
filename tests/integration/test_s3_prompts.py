"""Prompt sets read from a real S3 server (Ceph RGW) by URI, and the preflight's errors for a missing object."""

from __future__ import annotations

import json

import pytest
import s3fs

from tests.unit.data.test_uri import ROWS, cfg_for
from unirl_core.config.preflight import check_prompt_data
from unirl_core.data import PromptDataConfig, load_prompts
from unirl_core.errors import ConfigError

pytestmark = pytest.mark.integration


def test_prompts_from_s3(s3_endpoint, s3_bucket, monkeypatch):
    fs = s3fs.S3FileSystem(**s3_endpoint.storage_options)
    fs.pipe_file(f"{s3_bucket}/data/train.jsonl".removeprefix("s3://"),
                 "".join(json.dumps(r) + "\n" for r in ROWS).encode())
    uri = f"{s3_bucket}/data/train.jsonl"
    opts = json.dumps(s3_endpoint.storage_options)
    ds = load_prompts(PromptDataConfig(path=uri, storage_options=s3_endpoint.storage_options))
    assert [r.prompt for r in ds.records] == [r["prompt"] for r in ROWS]
    check_prompt_data(cfg_for(uri, f"data.file.storage_options={opts}"))
    with pytest.raises(ConfigError, match=r"data\.file\.path='s3://.*/data/missing\.jsonl'.*missing file"):
        check_prompt_data(cfg_for(f"{s3_bucket}/data/missing.jsonl", f"data.file.storage_options={opts}"))
