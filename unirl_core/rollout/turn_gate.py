"""Turn-boundary suspension of running agentic rollouts while the driver quiesces the rollout manager.

A multi-turn rollout can stop between two turns without losing anything: its state is the conversation (token
ids, environment objects), not a KV cache. So ``RolloutManager.quiesce()`` need not drain agentic work to its end:
it closes the gate, every running rollout finishes the turn in flight and parks at the next boundary, and quiesce
returns once every started rollout is parked or done (work not started yet parks before it touches the model).
The driver then changes weights (publish, eval); ``resume()`` opens the gate and the parked rollouts continue,
under the version their ``TurnHook`` picks (``unirl_core/loop/agent_lagged.py``).

Pure threading; the rollout side calls ``enter`` / ``leave`` around its work and ``park`` at boundaries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from unirl_core.errors import InvariantError, field_error

_POLL_S = 0.2


class TurnGate:
    """Open: rollouts run. Closed (``close``): rollouts park at their next turn boundary until ``open``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self._shutdown = False
        self._active = 0
        self._parked = 0
        self.parks = 0
        """Boundaries at which a rollout parked (tests and metrics read it)."""

    # -- driver side (the manager) ------------------------------------------------------------
    def close(self) -> None:
        """Ask every running rollout to park at its next turn boundary."""
        with self._cond:
            self._closed = True

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()

    def all_parked(self) -> bool:
        """True when no started rollout is between two boundaries (all parked, or none running)."""
        with self._cond:
            return self._parked == self._active

    def notify(self) -> None:
        """Something a parked rollout waits for changed (a version was published)."""
        with self._cond:
            self._cond.notify_all()

    def shutdown(self) -> None:
        """Wake every parked rollout with an error (the run is closing)."""
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- rollout side -------------------------------------------------------------------------
    def enter(self) -> None:
        """A rollout starts; while the gate is closed it parks first (before it loads any weights)."""
        with self._cond:
            self._active += 1
        self.park()

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def park(self, until: Callable[[], bool] = lambda: True) -> None:
        """Wait at a boundary while the gate is closed or ``until()`` is False; counted as parked meanwhile."""
        with self._cond:
            if not self._closed and until():
                return
            self._parked += 1
            self.parks += 1
            self._cond.notify_all()
            try:
                while self._closed or not until():
                    if self._shutdown:
                        raise field_error(InvariantError, "agentic rollout", "parked", "a resume",
                                          "the lagged rollouts were closed while a rollout waited at a turn boundary")
                    self._cond.wait(timeout=_POLL_S)
            finally:
                self._parked -= 1
