"""pyflyte plugin: ``pyflyte run --remote`` / ``register`` without a reachable backend fail in one line, and bad
input to a run (a recipe typo, a refused override, non-JSON ``--overrides``) is one message, not a traceback.

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

Bad input: pyflyte prints a task's exception as a rich traceback (45-300 lines of frames above the message). When
the exception is the library's ``ConfigError`` or ``CheckpointError`` (a field, its value and the fix: the user's
input), the plugin prints that message alone, naming the task; ``pyflyte -v run ...`` or ``UNIRL_TRACEBACK=1``
shows the traceback as before. Any other exception (a bug, a numerics failure) keeps its traceback. Non-JSON
``--overrides`` gets the form by example.
"""

from __future__ import annotations

import os
import re

import click
from flytekit.clis.sdk_in_container import utils as pyflyte_utils
from flytekit.configuration.plugin import FlytekitPlugin

from unirl_core.errors import CheckpointError, ConfigError
from workflows.remote_check import check

OVERRIDES_FORM = """a JSON list of "a.b=value" strings, e.g. --overrides '["loop.total_steps=4", "train.lr=1e-4"]'"""


def _input_error(e: BaseException) -> BaseException | None:
    """The library's bad-input error in ``e``'s chain of causes, if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (ConfigError, CheckpointError)):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _print_exception(e: Exception, verbosity: int = 0, *, default=pyflyte_utils.pretty_print_exception) -> None:
    """pyflyte's exception printer, with bad input said in one message (see the module docstring)."""
    if isinstance(e, click.BadParameter) and e.param is not None and e.param.name == "overrides":
        raise click.BadParameter(f"{OVERRIDES_FORM}; {e.message}", ctx=e.ctx, param=e.param) from e
    err = _input_error(e)
    if err is None or verbosity > 0 or os.environ.get("UNIRL_TRACEBACK", "0") == "1":
        default(e, verbosity)
        return
    # flytekit prefixes a task's exception with the task it ran in
    m = re.match(r"Error encountered while executing '([^']+)':\s*(.*)", str(err), flags=re.S)
    task, message = (m.group(1), m.group(2)) if m else (None, str(err))
    click.secho(f"{type(err).__name__}{f' in {task}' if task else ''}: {message}", fg="red", err=True)
    click.secho("(pyflyte -v run ... or UNIRL_TRACEBACK=1 shows the traceback)", err=True)


class UnirlFlytekitPlugin(FlytekitPlugin):
    """flytekit's default plugin with a reachability preflight in ``get_remote`` and bad input in one message."""

    @staticmethod
    def configure_pyflyte_cli(main: click.Group) -> click.Group:
        pyflyte_utils.pretty_print_exception = _print_exception  # looked up by pyflyte's command at each error
        return FlytekitPlugin.configure_pyflyte_cli(main)

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
