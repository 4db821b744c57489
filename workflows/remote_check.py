"""Preflight for ``pyflyte run --remote`` / ``pyflyte register``: is a Flyte backend configured and reachable?

    python -m workflows.remote_check [--config PATH]

Prints one line and exits 0 (``ok: ...``) or 1 (what is wrong and what to configure). pyflyte itself runs
before any code of this project, so without a backend ``pyflyte run --remote`` still prints flytekit's own
long traceback (it ends in a failed signed-URL request for the fast-register upload); run this first.

Checks, in flytekit's order of precedence: the config file (``--config``, else ``FLYTECTL_CONFIG``, else
``./flytekit.config``, ``~/.flyte/config``, ``~/.flyte/config.yaml``), then a TCP connection to its
``admin.endpoint`` (``FLYTE_PLATFORM_URL`` overrides it, as in flytekit). It does not log in: an endpoint that
answers may still refuse your credentials. Importing this module does nothing (``pyflyte --pkgs workflows``
loads every module of the package).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from urllib.parse import urlsplit

FIX_CONFIG = ("write ~/.flyte/config.yaml with admin.endpoint: dns:///<your flyteadmin host> (flytectl config init "
              "--host <host>), or point FLYTECTL_CONFIG / pyflyte --config at one")


def _host_port(endpoint: str, insecure: bool) -> tuple[str, int]:
    """``dns:///flyte.example.com``, ``flyte.example.com:443``, ``localhost:30080``, ``https://h`` -> (host, port)."""
    e = endpoint.strip()
    e = e.removeprefix("dns:///")
    if "://" not in e:
        e = "//" + e
    parts = urlsplit(e)
    default = 80 if (insecure or parts.scheme == "http") else 443
    return parts.hostname or "", parts.port or default


def check(config: str | None = None, *, timeout: float = 3.0) -> tuple[bool, str]:
    """(ok, the one line to print)."""
    from flytekit.configuration import PlatformConfig
    from flytekit.configuration.file import get_config_file

    cfg_file = get_config_file(config)
    if cfg_file is None and not os.environ.get("FLYTE_PLATFORM_URL"):
        return False, ("no Flyte config found, so pyflyte would use its built-in localhost:30080: " + FIX_CONFIG)
    where = "FLYTE_PLATFORM_URL" if cfg_file is None else (getattr(cfg_file, "_location", None) or "the Flyte config")
    platform = PlatformConfig.auto(cfg_file)
    host, port = _host_port(platform.endpoint, platform.insecure)
    if not host:
        return False, f"{where}: admin.endpoint={platform.endpoint!r} names no host; {FIX_CONFIG}"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        return False, (f"{where}: admin.endpoint={platform.endpoint!r} is not reachable at {host}:{port} "
                       f"({type(e).__name__}: {e}); start/port-forward the Flyte backend or fix admin.endpoint "
                       f"(and admin.insecure for a plain-text port)")
    return True, (f"ok: {where}: admin.endpoint={platform.endpoint!r} answers at {host}:{port} "
                  "(credentials are checked by pyflyte itself)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.remote_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "-c", help="Flyte config file (as pyflyte --config)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds for the TCP connection (default 3)")
    args = p.parse_args(argv)
    ok, line = check(args.config, timeout=args.timeout)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
