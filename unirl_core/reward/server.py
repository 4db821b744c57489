"""The remote reward server: FastAPI + uvicorn, serving the registered scorers over Arrow IPC.

    UNIRL_REWARD_TOKEN=... python -m unirl_core.reward.server --port 8431 --token-env UNIRL_REWARD_TOKEN

``POST /score`` (bearer token) takes an Arrow IPC request (see ``wire.py``) and answers with
per-component scores and per-item errors; the client's RewardService applies the failure
policy. ``GET /health`` needs no token. Scorers are built on first use and cached per
(name, kwargs); scoring runs on a small thread pool so the event loop keeps answering health
checks and rejecting bad requests while a batch is scored.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import importlib
import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from unirl_core.errors import ConfigError, SchemaError, field_error
from unirl_core.reward.config import RewardComponent
from unirl_core.reward.scorers.base import ComponentScores, ScoreItem, Scorer, build_scorer, run_scorer, scorer_names
from unirl_core.reward.wire import CONTENT_TYPE, decode_request, encode_response

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Limits and auth of one server process."""

    token: str
    """Bearer token every ``/score`` request must carry."""
    max_request_bytes: int = 64 * 2**20
    """Larger request bodies are refused with 413 before they are read."""
    request_timeout_s: float = 300.0
    """A request whose scoring takes longer gets 504 (the scoring thread finishes in the background)."""
    workers: int = 1
    """Scoring threads; 1 serialises batches, which suits one accelerator and non-thread-safe scorers."""
    allowed_components: tuple[str, ...] | None = None
    """Scorer names this server serves; None serves every registered scorer."""

    def __post_init__(self) -> None:
        if not self.token:
            raise field_error(ConfigError, "server.token", "", "a non-empty token",
                              "export a random token, e.g. `export UNIRL_REWARD_TOKEN=$(openssl rand -hex 16)`")
        if self.max_request_bytes < 1 or self.request_timeout_s <= 0 or self.workers < 1:
            raise field_error(ConfigError, "server limits",
                              (self.max_request_bytes, self.request_timeout_s, self.workers),
                              "max_request_bytes >= 1, request_timeout_s > 0, workers >= 1", "fix the flags")


class ScorerCache:
    """Built scorers keyed by (name, kwargs JSON); building happens once, under a lock."""

    def __init__(self) -> None:
        self._scorers: dict[tuple[str, str], Scorer] = {}
        self._lock = threading.Lock()

    def get(self, comp: RewardComponent) -> Scorer:
        key = (comp.name, json.dumps(comp.kwargs, sort_keys=True))
        with self._lock:
            if key not in self._scorers:
                logger.info("building scorer %s %s", comp.name, key[1])
                self._scorers[key] = build_scorer(comp.name, **comp.kwargs)
            return self._scorers[key]

    def loaded(self) -> list[str]:
        with self._lock:
            return sorted({name for name, _ in self._scorers})


def score_request(cache: ScorerCache, items: list[ScoreItem], comps: list[RewardComponent],
                  isolate: bool) -> list[ComponentScores]:
    return [run_scorer(cache.get(c), items, name=c.name, isolate=isolate) for c in comps]


def create_app(cfg: ServerConfig, cache: ScorerCache | None = None) -> FastAPI:
    """The ASGI app; ``cache`` may be pre-filled (``--preload``)."""
    app = FastAPI(title="unirl reward server", docs_url=None, redoc_url=None)
    cache = cache or ScorerCache()
    pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="score")
    expected = f"Bearer {cfg.token}".encode()

    def error(status: int, msg: str, **headers: str) -> JSONResponse:
        return JSONResponse({"error": msg}, status_code=status, headers=headers or None)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "scorers_loaded": cache.loaded(),
                "scorers_available": list(cfg.allowed_components or scorer_names())}

    @app.post("/score")
    async def score(request: Request):
        auth = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(auth, expected):
            return error(401, "missing or wrong bearer token", **{"WWW-Authenticate": "Bearer"})
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_request_bytes:
            return error(413, f"request of {declared} bytes exceeds the limit of {cfg.max_request_bytes}")
        t_start = time.perf_counter()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_request_bytes:  # chunked uploads carry no content-length
                return error(413, f"request exceeds the limit of {cfg.max_request_bytes} bytes")
            chunks.append(chunk)
        try:
            items, comps, isolate = decode_request(b"".join(chunks))
            refused = [c.name for c in comps if cfg.allowed_components and c.name not in cfg.allowed_components]
            if refused:
                return error(403, f"components {refused} are not served here (allowed: {cfg.allowed_components})")
        except (SchemaError, ConfigError) as e:
            return error(400, str(e))
        t_read = time.perf_counter()
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(pool, score_request, cache, items, comps, isolate)
        try:
            results = await asyncio.wait_for(job, timeout=cfg.request_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("request of %d items timed out after %.1f s", len(items), cfg.request_timeout_s)
            return error(504, f"scoring took longer than {cfg.request_timeout_s} s")
        except ConfigError as e:
            return error(400, str(e))
        except Exception as e:  # noqa: BLE001 - e.g. a model that fails to load; report, keep serving
            logger.exception("scoring failed")
            return error(500, f"{type(e).__name__}: {e}")
        t_score = time.perf_counter()
        # Server-Timing (W3C) lets a client tell transfer cost from scoring cost.
        timing = f"read;dur={(t_read - t_start) * 1e3:.1f}, score;dur={(t_score - t_read) * 1e3:.1f}"
        return Response(content=encode_response(results), media_type=CONTENT_TYPE,
                        headers={"Server-Timing": timing})

    app.router.on_shutdown.append(lambda: pool.shutdown(wait=False, cancel_futures=True))
    return app


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m unirl_core.reward.server", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--token-env", default="UNIRL_REWARD_TOKEN", help="environment variable holding the token")
    p.add_argument("--max-request-mb", type=float, default=64.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request scoring timeout")
    p.add_argument("--workers", type=int, default=1, help="scoring threads")
    p.add_argument("--allow", action="append", default=None, help="serve only these scorers (repeatable)")
    p.add_argument("--import", dest="imports", action="append", default=[],
                   help="import a module first (it may call register_scorer); repeatable")
    p.add_argument("--preload", action="append", default=[],
                   help="build this scorer with default kwargs before serving (repeatable)")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = os.environ.get(args.token_env, "")
    if not token:
        sys.exit(f"environment variable {args.token_env} is empty: export the bearer token before starting")
    for module in args.imports:
        importlib.import_module(module)
    cfg = ServerConfig(token=token, max_request_bytes=int(args.max_request_mb * 2**20),
                       request_timeout_s=args.timeout_s, workers=args.workers,
                       allowed_components=tuple(args.allow) if args.allow else None)
    cache = ScorerCache()
    for name in args.preload:
        cache.get(RewardComponent(name=name))
    import uvicorn

    uvicorn.run(create_app(cfg, cache), host=args.host, port=args.port, log_level=args.log_level,
                timeout_keep_alive=30)


if __name__ == "__main__":
    main()
