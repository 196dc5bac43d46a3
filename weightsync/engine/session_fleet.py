"""The fleet's side of an engine's weight state: stale, joining from a peer, donating to one.

A mixin of :class:`~weightsync.engine.session.UpdateSessions` (the same state, the same lock,
the same table, :data:`weightsync.engine.states.TRANSITIONS`): ``/mark_stale`` (the fleet
published a version without this engine), a join from peers (the copy itself is
:mod:`weightsync.engine.join`'s; here its start, progress, publication and failure), and the
donations to joining peers, during which flips and in-place writes wait (the donor copies its
served copy while it generates, so that copy must not change under the copy).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from weightsync.engine.control import Op
from weightsync.engine.scheduler import EngineTimeout, Scheduler
from weightsync.engine.states import Event, Rule, State

DONATION_HOLD_S = 600.0
"""How long a flip or an in-place write waits for the donations to joining peers to end."""


class FleetSessions:
    """The ``mark_stale``, ``join_from_peer`` and ``donate_weights`` rows (module docstring)."""

    lock: threading.Condition
    scheduler: Scheduler
    driver: Any
    state: State
    dirty: bool
    stale: bool
    session: Any
    weight_version: str
    fleet_version: str | None
    join_reason: str
    join_error: str
    _donations: int
    _flipping: int
    _decide: Callable[..., Rule]
    _enter: Callable[[Rule], None]
    _fail_queued_if_refused: Callable[[], None]
    _flip: Callable[[str | None], dict[str, Any]]
    _published: Callable[[str], None]
    reason: Callable[[], str]

    def mark_stale(self, published_version: str) -> dict[str, Any]:
        """``/mark_stale``: the fleet published ``published_version`` without this engine. An
        engine that holds it already (clean, at that version) stays as it is; otherwise the
        ``mark_stale`` rows: an open session is aborted, generation stops, requests get 503."""
        with self.lock:
            if self.state is not State.JOINING and not self.dirty and self.weight_version == published_version:
                return {"stale": False, "state": self.state.value, "weight_version": self.weight_version}
            rule = self._decide(Event.MARK_STALE)
            self.fleet_version, self.join_error = published_version, ""  # an older join's failure no longer says why
            aborted = self.session is not None and self.state is not State.JOINING
            if rule.then is not None:
                self.session, self.stale, self.dirty = None, True, True
            self._enter(rule)
            self._fail_queued_if_refused()
        self.scheduler.stop_generation("Aborted", retract=False)
        if aborted:
            self.driver.engine.broadcast.cancel_receives()
            self.scheduler.call(lambda: self.driver.run(Op.ABORT_UPDATE), "mark_stale")
        with self.lock:
            return {"stale": True, "state": self.state.value, "weight_version": self.weight_version,
                    "reason": self.reason()}

    def start_join(self, reason: str) -> None:
        """A join from peers begins (the ``join_from_peer`` rows): nothing is served until it ends.

        Raises:
            Conflict: a join or an update session is in progress.
        """
        with self.lock:
            rule = self._decide(Event.JOIN)
            self.join_reason = reason
            self._enter(rule)
            self._fail_queued_if_refused()
        self.scheduler.stop_generation("Aborted", retract=False)

    def join_progress(self, reason: str) -> None:
        """What the join does now (the reason a joining engine gives)."""
        with self.lock:
            self.join_reason = reason

    def finish_join(self, version: str) -> dict[str, Any]:
        """The copy from a peer is in the session's copy, post-loaded and verified: flip it in at
        ``version`` (the ``join verified`` row); returns the flip's facts."""
        with self.lock:
            rule = self._decide(Event.JOINED)
        published = self._flip(version)
        with self.lock:
            self._published(version)
            self._enter(rule)
        return published

    def fail_join(self, errors: str) -> None:
        """Every peer failed (the ``join fails on every peer`` row): stale, dirty, ``errors`` in the reason."""
        with self.lock:
            rule = self._decide(Event.JOIN_FAILED)
            self.join_error, self.stale, self.dirty = errors, True, True
            self._enter(rule)

    def begin_donation(self) -> str:
        """A joining peer copies the served copy (the ``donate_weights`` rows): flips and in-place
        writes wait until :meth:`end_donation`. Returns the version it gets.

        Raises:
            Conflict: nothing current to give (joining, stale, dirty, a paused session open).
            EngineTimeout: a flip did not end in time.
        """
        with self.lock:
            if not self.lock.wait_for(lambda: self._flipping == 0, timeout=DONATION_HOLD_S):
                raise EngineTimeout(f"a flip did not end within {DONATION_HOLD_S:.0f} s")
            self._decide(Event.DONATE)
            self._donations += 1
            return self.weight_version

    def end_donation(self) -> None:
        with self.lock:
            self._donations -= 1
            self.lock.notify_all()

    def _await_donations(self, what: str) -> None:
        """Wait (lock held) until no peer copies the served copy.

        Raises:
            EngineTimeout: a donation did not end within :data:`DONATION_HOLD_S`.
        """
        if not self.lock.wait_for(lambda: self._donations == 0, timeout=DONATION_HOLD_S):
            raise EngineTimeout(f"{what} waited {DONATION_HOLD_S:.0f} s for a copy to a joining peer to end")
