"""Real flytekit local execution passing SampleBatch between tasks."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch
from flytekit import task, workflow
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import TypeEngine

import tasks.types  # noqa: F401  (registers the transformer)
from tasks.types import ARROW_IPC_FORMAT, HashedSampleBatch
from unirl_core.errors import SchemaError
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch, TokenSegment

CALLS = os.environ.setdefault("UNIRL_TEST_CALLS", f"/tmp/unirl-calls-{uuid.uuid4().hex}")
VERSION = uuid.uuid4().hex  # isolates this test run in the shared local cache


def _count() -> None:
    with open(CALLS, "a") as f:
        f.write("x")


@task
def make_batch(n: int) -> HashedSampleBatch:
    b = SampleBatch.from_prompts([PromptRecord(prompt_id=f"q{i}", prompt=f"1+{i}=") for i in range(n)],
                                 samples_per_prompt=2, kind="ar", sampling=ARSamplingParams(max_new_tokens=4),
                                 metadata={"step": "1"})
    for k, s in enumerate(b):
        s.generated.segment = TokenSegment(prompt_ids=torch.arange(3), response_ids=torch.arange(k + 1),
                                           log_probs=-torch.rand(k + 1, generator=torch.Generator().manual_seed(k)),
                                           response_mask=torch.ones(k + 1, dtype=torch.bool), finish_reason="stop")
        s.generated.text = str(k)
    return b


@task(cache=True, cache_version=VERSION)
def score(batch: SampleBatch) -> SampleBatch:
    _count()
    for s in batch:
        s.generated.reward = float(s.generated.segment.log_probs.sum())
    return batch


@workflow
def pipeline(n: int = 2) -> SampleBatch:
    return score(batch=make_batch(n=n))


def test_two_tasks_pass_a_sample_batch():
    expected = make_batch(n=2)
    got = pipeline(n=2)
    assert isinstance(got, SampleBatch) and len(got) == 4 and got.metadata == {"step": "1"}
    for a, b in zip(expected, got):
        assert torch.equal(a.generated.segment.log_probs, b.generated.segment.log_probs)
        assert b.generated.reward == float(a.generated.segment.log_probs.sum())


def test_unchanged_input_hits_the_cache():
    before = os.path.getsize(CALLS) if os.path.exists(CALLS) else 0
    pipeline(n=3)
    pipeline(n=3)  # make_batch re-uploads to a new random path; the content hash is the same
    assert os.path.getsize(CALLS) - before == 1
    pipeline(n=1)
    assert os.path.getsize(CALLS) - before == 2


def test_literal_is_an_arrow_ipc_blob_with_content_hash():
    ctx = FlyteContextManager.current_context()
    b = make_batch(n=1)
    lt = TypeEngine.to_literal_type(SampleBatch)
    lit1 = TypeEngine.to_literal(ctx, b, HashedSampleBatch, lt)
    lit2 = TypeEngine.to_literal(ctx, make_batch(n=1), HashedSampleBatch, lt)
    lit3 = TypeEngine.to_literal(ctx, make_batch(n=2), HashedSampleBatch, lt)
    assert lt.blob.format == ARROW_IPC_FORMAT
    assert lit1.scalar.blob.uri != lit2.scalar.blob.uri and lit1.hash == lit2.hash != lit3.hash
    assert lit1.hash.startswith("sha256:")
    html = TypeEngine.to_html(ctx, b, SampleBatch)
    assert "q0/1" in html and "<script" not in html


def test_a_cached_output_whose_file_is_gone_names_the_file_and_the_fix():
    """A local cache hit whose Arrow file went with a wiped temp dir fails naming the file and how to clear the
    cache, not with a bare missing-file error (real flytekit local execution and local cache)."""
    raw = Path(FlyteContextManager.current_context().file_access.raw_output_prefix)
    before = set(raw.glob("*/batch.arrow"))
    pipeline(n=6)
    gone = set(raw.glob("*/batch.arrow")) - before
    assert len(gone) == 2  # make_batch's output and score's (now in the cache)
    for f in gone:
        f.unlink()
    with pytest.raises(Exception) as info:
        pipeline(n=6)  # make_batch runs again; score is a cache hit naming a removed file
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    errors = [e for e in chain if isinstance(e, SchemaError)]
    assert errors, [repr(e)[:200] for e in chain]
    msg = str(errors[0])
    assert "SampleBatch literal uri=" in msg and "batch.arrow" in msg
    assert "pyflyte local-cache clear" in msg and "--overwrite-cache" in msg
