"""A managed inference-server child process and a small JSON-over-HTTP client.

Dedicated engines (vLLM, SGLang) run in their own process, usually from their own virtual
environment, so their pinned dependencies never meet the trainer's. This module owns what the two
have in common: picking a free port, launching the server with a chosen Python executable, waiting
for its health endpoint while watching that the process is still alive, keeping its log in a file
whose tail goes into every error, and stopping the whole process group on close.

The client is stdlib ``urllib`` on purpose: the library adds no HTTP dependency, and a request is
one blocking call that threads can issue concurrently.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from unirl_core.errors import EngineError, field_error

logger = logging.getLogger(__name__)

_LOG_TAIL_CHARS = 4000

_WATCHDOG = """
import os, signal, sys, time
owner, started, pgid, grace = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])

def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None

def group_alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False

while group_alive() and start_time(owner) == started:  # a reused pid has another start time
    time.sleep(0.5)
if group_alive():
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if group_alive():
        os.killpg(pgid, signal.SIGKILL)
"""
"""The ``stop_with_parent`` watchdog (Linux ``/proc``): argv owner pid, its start time, server pgid, grace s."""


def _start_time(pid: int) -> str:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks): a pid with its start time names one process."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host`` (bind to 0, read it, close).

    The usual bind-to-zero race remains: another process may take the port before the server
    binds it. ``ManagedServer.start`` then fails with the server's own "address in use" log.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class HTTPJSONClient:
    """POST/GET JSON to one base URL; every failure becomes an ``EngineError`` naming the endpoint."""

    def __init__(self, base_url: str, *, timeout_s: float, headers: Mapping[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json", **dict(headers or {})}

    def request(self, method: str, path: str, body: object | None = None, *,
                timeout_s: float | None = None, expect_json: bool = True) -> object:
        """Send one request; returns the decoded JSON body (``None`` for an empty body, the text when
        ``expect_json`` is False)."""
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(url, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:2000]
            raise field_error(EngineError, f"{method} {url}", e.code, "HTTP 200",
                              f"the server answered: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            raise field_error(EngineError, f"{method} {url}", type(e).__name__, "a reachable server",
                              f"check that the server is up and the URL is right ({e})") from None
        if not raw.strip():
            return None
        if not expect_json:
            return raw.decode("utf-8", "replace")
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise field_error(EngineError, f"{method} {url}", raw[:200], "a JSON body",
                              "the endpoint is not the expected API; check the server version") from None

    def post(self, path: str, body: object | None = None, **kw) -> object:
        return self.request("POST", path, {} if body is None else body, **kw)

    def get(self, path: str, **kw) -> object:
        return self.request("GET", path, None, **kw)

    def is_healthy(self, path: str) -> bool:
        """True when ``GET path`` answers 200 within a short timeout."""
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=2.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError):
            return False


class ManagedServer:
    """One server child process in its own process group, with its output in a log file."""

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str], name: str,
                 log_dir: str | None = None) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.name = name
        folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"unirl-{name}-"))
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / f"{name}.log"
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, client: HTTPJSONClient, *, health_path: str, timeout_s: float) -> None:
        """Launch and block until ``health_path`` answers 200; fail fast if the process exits."""
        logger.info("starting %s: %s (log: %s)", self.name, " ".join(self.argv), self.log_path)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            # A new session puts the server and the workers it spawns in one process group,
            # so close() can stop all of them without touching anything else.
            self._proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        while True:
            if self._proc.poll() is not None:
                raise field_error(EngineError, f"{self.name}.exit_code", self._proc.returncode,
                                  "a running server", f"it exited during startup; log tail:\n{self.log_tail()}")
            if client.is_healthy(health_path):
                logger.info("%s healthy after %.1f s", self.name, time.monotonic() - t0)
                return
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise field_error(EngineError, f"{self.name}.startup_timeout_s", timeout_s,
                                  f"{client.base_url}{health_path} healthy in time",
                                  f"raise the startup timeout on a busy machine; log tail:\n{self.log_tail()}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def raise_if_dead(self) -> None:
        """Turn a server that died under a request into an error that carries its log tail."""
        if self._proc is not None and self._proc.poll() is not None:
            raise field_error(EngineError, f"{self.name}.exit_code", self._proc.returncode, "a running server",
                              f"it died while serving; log tail:\n{self.log_tail()}")

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "<no log>"
        return text[-chars:]

    def stop_with_parent(self, grace_s: float = 15.0) -> subprocess.Popen | None:
        """Start a watchdog that stops this server's process group once this process is gone.

        ``stop`` runs when the owner closes the engine (or exits normally); a SIGKILLed owner (a Ray actor killed
        with its node's OOM killer or ``ray.kill``) runs nothing, and the server (its own session) would live on,
        holding its port and memory. The watchdog is a session of its own, so whatever kills the owner's process
        group spares it; it exits on its own once the server group is gone."""
        if self._proc is None:
            return None
        import sys

        return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), _start_time(os.getpid()),
                                 str(self._proc.pid), str(grace_s)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``grace_s``."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        pgid = os.getpgid(proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0f s; killing it", self.name, grace_s)
            os.killpg(pgid, signal.SIGKILL)
            proc.wait(timeout=grace_s)
        # Workers may outlive the parent for a moment; the group id is still theirs.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
