"""HTTP client of the reward server: Arrow IPC bodies, bearer token, retries with exponential backoff."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence

import httpx

from unirl_core.errors import RemoteRewardUnavailable, RewardError
from unirl_core.reward.config import RewardComponent
from unirl_core.reward.scorers.base import ComponentScores, ScoreItem
from unirl_core.reward.wire import CONTENT_TYPE, decode_response, encode_request

logger = logging.getLogger(__name__)

# Worth another try: the server may be restarting, overloaded, or behind a proxy that timed out.
_RETRY_STATUS = {502, 503, 504}


class RemoteRewardClient:
    """Sends one request per call; ``score`` retries transient failures and raises RewardError otherwise."""

    def __init__(self, url: str, *, token: str | None, timeout_s: float = 120.0, retries: int = 3,
                 backoff_s: float = 0.5, max_in_flight: int = 2) -> None:
        self.url = url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s,
                                  limits=httpx.Limits(max_connections=max(1, max_in_flight)))
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_in_flight), thread_name_prefix="reward-client")
        self.max_in_flight = max_in_flight

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def __enter__(self) -> RemoteRewardClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def health(self) -> dict:
        """The server's ``/health`` JSON (no auth needed)."""
        resp = self._http.get("/health")
        resp.raise_for_status()
        return resp.json()

    def score(self, components: Sequence[RewardComponent], items: Sequence[ScoreItem], *,
              isolate: bool) -> list[ComponentScores]:
        """Scores of every component over ``items`` (one request), in component order."""
        body = encode_request(items, components, isolate=isolate)
        resp = self._post_with_retries(body)
        logger.debug("scored %d items; server timing: %s", len(items), resp.headers.get("server-timing"))
        return decode_response(resp.content, num_components=len(components), num_items=len(items))

    def score_chunks(self, components: Sequence[RewardComponent], chunks: Sequence[Sequence[ScoreItem]], *,
                     isolate: bool) -> list[list[ComponentScores]]:
        """``score`` over several chunks with up to ``max_in_flight`` requests open at once.

        Two in flight let the server read and decode chunk k+1 while its scoring thread works on
        chunk k, which hides most of the transfer cost. Results come back in chunk order; the
        first failing chunk raises.
        """
        if self.max_in_flight <= 1 or len(chunks) <= 1:
            return [self.score(components, c, isolate=isolate) for c in chunks]
        futures = [self._pool.submit(self.score, components, c, isolate=isolate) for c in chunks]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()

    def _post_with_retries(self, body: bytes) -> httpx.Response:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                delay = self.backoff_s * 2 ** (attempt - 1)
                logger.warning("reward server %s: %s; retry %d/%d in %.2f s", self.url, last, attempt,
                               self.retries, delay)
                time.sleep(delay)
            try:
                resp = self._http.post("/score", content=body, headers={"Content-Type": CONTENT_TYPE})
            except httpx.TransportError as e:  # connect / read / write errors and timeouts
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code == 200:
                return resp
            last = f"HTTP {resp.status_code}: {resp.text[:300]}"
            if resp.status_code not in _RETRY_STATUS:
                raise RewardError(f"reward server {self.url} refused the request ({last}); "
                                  + _hint(resp.status_code))
        raise RemoteRewardUnavailable(f"reward server {self.url} failed after {self.retries + 1} attempts (last: {last}); "
                          "check that it is running and raise remote_timeout_s for slow scorers")


def _hint(status: int) -> str:
    return {
        401: "set the token in the environment variable named by reward.remote_token_env",
        413: "lower reward.batch_size or start the server with a larger --max-request-mb",
        400: "client and server versions may differ",
    }.get(status, "see the server log")
