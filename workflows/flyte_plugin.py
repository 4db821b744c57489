"""pyflyte plugin: ``pyflyte run --remote`` / ``register`` without a reachable backend fail in one line.

Local ``pyflyte run`` (no ``--remote``) is untouched: pyflyte creates a remote there too, but without an upload
location, and the check runs only for calls that upload to a backend.

flytekit creates its ``FlyteRemote`` through the plugin registered under the entry-point group
``flytekit.configuration.plugin`` (this project registers ``UnirlFlytekitPlugin``; see pyproject.toml). Before
handing the remote to pyflyte, the plugin runs ``workflows.remote_check.check`` on the same config: with no
config file, or an endpoint that does not answer, pyflyte stops with one line naming the config source, the
endpoint and what to configure, instead of flytekit's long traceback ending in a signed-URL error. Everything
else is flytekit's default plugin. flytekit allows one such plugin per environment: another installed one
(e.g. a vendor's) makes pyflyte refuse to start with "Multiple plugins installed"; uninstall one of them.
``UNIRL_REMOTE_CHECK=0`` skips the check (e.g. behind a proxy that TCP probes cannot pass).
"""

from __future__ import annotations

import os

import click
from flytekit.configuration.plugin import FlytekitPlugin

from workflows.remote_check import check


class UnirlFlytekitPlugin(FlytekitPlugin):
    """flytekit's default plugin with a reachability preflight in ``get_remote``."""

    @staticmethod
    def get_remote(config, project, domain, data_upload_location=None):
        # pyflyte asks for a remote in local runs too (for its file access), without an upload location; only
        # the commands that upload to a backend (run --remote, register, launchplan) pass one.
        if data_upload_location is not None and os.environ.get("UNIRL_REMOTE_CHECK", "1") != "0":
            ok, line = check(config)
            if not ok:
                raise click.ClickException(f"unirl: {line} (python -m workflows.remote_check re-checks; "
                                           "UNIRL_REMOTE_CHECK=0 skips this check)")
        return FlytekitPlugin.get_remote(config, project, domain, data_upload_location)
