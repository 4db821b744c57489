"""Typed errors raised at every library boundary.

Each message names the field, the value that was seen, what was expected, and the likely fix.
"""

from collections.abc import Iterable


class UniRLError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(UniRLError, ValueError):
    """A configuration field has a value that cannot work."""


class InvariantError(UniRLError, ValueError):
    """A Sample, Part or segment violates a structural invariant (shapes, lengths, ids)."""


class SchemaError(UniRLError):
    """An Arrow file or table is damaged, truncated, foreign, or of another schema version."""


class NumericsError(UniRLError):
    """Numbers that must agree do not (pinned vs used sigmas, rollout vs replay log-probs)."""


class CheckpointError(UniRLError):
    """A checkpoint is missing, incomplete, or fails its checksum."""


class RewardError(UniRLError):
    """A reward scorer failed or returned a non-finite value under the fail-closed policy."""


class TransientError(UniRLError):
    """A failure a retry may fix (a service that timed out or was unreachable after the client's own retries).

    Orchestrators map it to their retry mechanism (Flyte: ``FlyteRecoverableException``)."""


class RemoteRewardUnavailable(RewardError, TransientError):
    """The reward server did not answer in time, or at all, after the client's retries."""


class PoolActorDied(TransientError):
    """An actor of the run's Ray pool died or became unreachable during a call. The next call re-creates it,
    and it resumes from the last published version (Flyte retries the task)."""


class EngineError(UniRLError):
    """A rollout engine could not start, serve, or fill a Sample."""


def field_error(cls: type[UniRLError], field: str, value: object, expected: str, fix: str) -> UniRLError:
    """Build an error whose message follows the house format: field, value, expectation, fix."""
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return cls(f"{field}={shown}: expected {expected}; {fix}")


def check_ints(section: str, obj: object, names: Iterable[str], fix: str, *, minimum: int = 1) -> None:
    """Refuse a field of ``obj`` among ``names`` that is not an integer >= ``minimum`` (a bool is none), naming
    ``<section>.<field>`` (a ``ConfigError``)."""
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise field_error(ConfigError, f"{section}.{name}", v, f"an integer >= {minimum}", fix)
