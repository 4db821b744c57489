"""The reward server as a real process on 127.0.0.1: scores, auth, size limit, timeouts, failure policy.

The server is started with ``--import`` of this module so the test-only scorers below exist there.
"""

import io
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from unirl_core.errors import RewardError
from unirl_core.reward import RewardConfig, RewardService, register_scorer
from unirl_core.reward.client import RemoteRewardClient
from unirl_core.reward.wire import CONTENT_TYPE, encode_request
from unirl_core.types import DiffusionSamplingParams, PromptRecord, SampleBatch

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token-123"


class SleepScorer:
    """Sleeps ``seconds`` per call, then scores 1.0 (to exercise timeouts)."""

    def __init__(self, seconds: float = 1.0):
        self.seconds = seconds

    def __call__(self, items):
        time.sleep(self.seconds)
        return [1.0] * len(items)


class PickyScorer:
    """NaN for prompts containing 'nan'; raises for prompts containing 'boom'; else 1.0."""

    def __call__(self, items):
        if any("boom" in it.prompt for it in items):
            raise ValueError("boom")
        return [math.nan if "nan" in it.prompt else 1.0 for it in items]


register_scorer("test_sleep", SleepScorer, replace=True)
register_scorer("test_picky", PickyScorer, replace=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*flags: str):
    port = _free_port()
    env = {**os.environ, "UNIRL_TEST_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "unirl_core.reward.server", "--port", str(port), "--token-env", "UNIRL_TEST_TOKEN",
           "--import", "tests.integration.test_reward_server", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"reward server exited with {proc.returncode}: {proc.stdout.read().decode()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("reward server did not become healthy in 90 s")


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server():
    proc, url = _start("--max-request-mb", "0.25", "--timeout-s", "60")
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def tight_server():
    proc, url = _start("--timeout-s", "0.5")
    yield url
    _stop(proc)


def _png(text: str = "", noise_seed: int | None = None, size=(320, 96)) -> bytes:
    if noise_seed is not None:
        img = Image.fromarray(np.random.default_rng(noise_seed).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))
    else:
        img = Image.new("RGB", size, "white")
        if text:
            ImageDraw.Draw(img).text((12, 28), text, fill="black", font=ImageFont.load_default(size=32))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _batch(prompts: list[str], media: list[bytes]) -> SampleBatch:
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=p) for i, p in enumerate(prompts)]
    batch = SampleBatch.from_prompts(recs, samples_per_prompt=1, kind="diffusion",
                                     sampling=DiffusionSamplingParams(sigmas=(1.0, 0.5, 0.0)))
    for s, m in zip(batch, media):
        s.generated.media = m
    return batch


def _cfg(url, comps, **kw):
    return RewardConfig(components=comps, backend="remote", remote_url=url, remote_token_env="UNIRL_TEST_TOKEN",
                        **{"remote_retries": 0, **kw})


@pytest.fixture(autouse=True)
def _token(monkeypatch):
    monkeypatch.setenv("UNIRL_TEST_TOKEN", TOKEN)


def test_remote_scores_equal_local(server):
    prompts = ['a sign "OPEN"', 'a sign "OPEN"', 'a sign "CLOSED"']
    media = [_png("OPEN"), _png(noise_seed=1, size=(64, 64)), _png("")]
    comps = [("jpeg_compressibility", 1.0, {}), ("ocr", 2.0, {"num_threads": 1})]
    remote = _batch(prompts, media)
    with RewardService(_cfg(server, comps, batch_size=2)) as svc:
        svc.score(remote)
    local = _batch(prompts, media)
    RewardService(RewardConfig(components=comps)).score(local)
    assert [s.generated.rewards for s in remote] == [s.generated.rewards for s in local]
    assert [s.generated.reward for s in remote] == [s.generated.reward for s in local]
    assert remote.samples[0].generated.rewards["ocr"] == 1.0 and remote.samples[2].generated.rewards["ocr"] == 0.0
    health = httpx.get(f"{server}/health").json()
    assert {"jpeg_compressibility", "ocr"} <= set(health["scorers_loaded"])


def test_auth(server):
    body = encode_request([], [], isolate=False)
    headers = {"Content-Type": CONTENT_TYPE}
    assert httpx.post(f"{server}/score", content=body, headers=headers).status_code == 401
    wrong = {**headers, "Authorization": "Bearer nope"}
    assert httpx.post(f"{server}/score", content=body, headers=wrong).status_code == 401
    right = {**headers, "Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{server}/score", content=body, headers=right).status_code == 200
    client = RemoteRewardClient(server, token="wrong", retries=2, backoff_s=5.0)
    start = time.monotonic()
    with pytest.raises(RewardError, match="HTTP 401.*remote_token_env"):
        client.score([], [], isolate=False)
    assert time.monotonic() - start < 4.0  # 4xx is not retried


def test_oversized_request_413(server):
    big = _png(noise_seed=2, size=(320, 320))  # ~300 kB of incompressible PNG > 0.25 MiB limit
    body = encode_request([], [], isolate=False) + big
    resp = httpx.post(f"{server}/score", content=body,
                      headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": CONTENT_TYPE})
    assert resp.status_code == 413

    def chunked():  # no content-length: the server counts while reading
        yield body[:1000]
        yield body[1000:]
    resp = httpx.post(f"{server}/score", content=chunked(), headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 413
    with RewardService(_cfg(server, [("jpeg_compressibility", 1.0, {})])) as svc:
        with pytest.raises(RewardError, match="HTTP 413.*batch_size"):
            svc.score(_batch(["x"], [big]))


def test_server_timeout_504_and_client_retries(tight_server):
    comps = [("test_sleep", 1.0, {"seconds": 1.0})]
    with RewardService(_cfg(tight_server, comps, remote_retries=1, remote_backoff_s=0.05)) as svc:
        start = time.monotonic()
        with pytest.raises(RewardError, match="after 2 attempts.*HTTP 504"):
            svc.score(_batch(["x"], [_png("x")]))
        assert time.monotonic() - start < 10


def test_client_timeout(server):
    comps = [("test_sleep", 1.0, {"seconds": 1.5})]
    with RewardService(_cfg(server, comps, remote_timeout_s=0.3, remote_retries=1, remote_backoff_s=0.05)) as svc:
        with pytest.raises(RewardError, match="after 2 attempts.*ReadTimeout"):
            svc.score(_batch(["x"], [_png("x")]))


@pytest.mark.parametrize("bad", ["nan", "boom"])
def test_failure_policy_over_the_wire(server, bad):
    prompts = ["fine", f"a {bad} prompt", "also fine"]
    media = [_png("a")] * 3
    with RewardService(_cfg(server, [("test_picky", 1.0, {})], failure_policy="mark_invalid")) as svc:
        batch, stats = svc.score_with_stats(_batch(prompts, media))
    assert [s.generated.valid for s in batch] == [True, False, True]
    assert [s.generated.reward for s in batch] == [1.0, None, 1.0] and stats.num_invalid == 1
    with RewardService(_cfg(server, [("test_picky", 1.0, {})])) as svc:
        with pytest.raises(RewardError, match="'test_picky' failed"):
            svc.score(_batch(prompts, media))


def test_unknown_component_400(server):
    with RewardService(_cfg(server, [("no_such_scorer", 1.0, {})])) as svc:
        with pytest.raises(RewardError, match="HTTP 400.*no_such_scorer"):
            svc.score(_batch(["x"], [_png("x")]))


def test_server_refuses_to_start_without_token():
    env = {k: v for k, v in os.environ.items() if k != "UNIRL_EMPTY_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "unirl_core.reward.server", "--token-env", "UNIRL_EMPTY_TOKEN"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "UNIRL_EMPTY_TOKEN" in out.stderr
