"""The live check: the served weights, fingerprinted on demand and on a schedule, against what was
published; a write that no session made flips the engine to dirty.

Some transports write the served parameters in place, and some accept writes from any process
that reaches them: Mooncake's TCP data port and RDMA queue pairs take writes into registered
memory from every peer that completed its handshake, with no authentication (docs/security.md).
Such a write between updates changes what the engine serves without any call. The live check
makes it detectable: when weights are published (at start, and by every session that
publishes) the check takes a *reference*, every rank's digest of every tensor of the served copy
(:meth:`~weightsync.engine.checker.WeightChecker.live_digest`: fingerprints with a seed of the
engine's own, never published, on a GPU; xxh64 on the CPU); then, every ``interval_s`` and on
demand (``/live_weights_check``), it computes them again and compares. A difference while no
session is open is the ``live weights changed outside a session`` event of the state table
(:mod:`weightsync.engine.states`): the weights become dirty and nothing is served until a session
writes, verifies and publishes them.

Each check runs as one job on the driver thread, between batches, and decides there, so no batch
starts on weights it found changed. It is skipped while a session is open, paused or pause-free
(its writes, or its flip, are expected), while the engine joins from a peer or is stale (what it
serves is not the fleet's version), on dirty weights (nothing is served), and when a publication
came since it began. Cost: one pass over the parameters per check (one kernel launch
on a GPU), during which generation waits. What it cannot see: a write between a publication and
the reference taken right after it, and a write undone before the next check.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from weightsync.engine.control import Op
from weightsync.engine.session import UpdateSessions
from weightsync.engine.states import NOT_LIVE_CHECKED, State

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the check's thread looks for a publication (a new reference is due) or its next check."""


class LiveCheck:
    """The live check of one engine (module docstring); a thread on rank 0 while it runs.

    Typical usage::

        check = LiveCheck(sessions, interval_s=60.0)
        check.start()         # takes the reference of the published weights, then checks on schedule
        check.check()         # now (``/live_weights_check``)
        check.stop()
    """

    def __init__(self, sessions: UpdateSessions, *, interval_s: float) -> None:
        """Args:
        sessions: the engine's update sessions (their lock guards the reference too).
        interval_s: seconds between scheduled checks; 0: on demand only.
        """
        self.sessions = sessions
        self.interval_s = interval_s
        self.reference: list[dict[str, str]] | None = None
        """Every rank's digests of the published weights."""
        self.seed = secrets.randbelow(1 << 63)
        """The fingerprints' seed: the engine's own, so a writer cannot aim at a known hash."""
        self.epoch = -1
        """The publication (``sessions.publications``) the reference belongs to."""
        self.checks = 0
        self.found = 0
        """Foreign writes found."""
        self._last = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="live-check", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _checkable(self) -> str:
        """Why there is nothing to check now ("" when there is; caller holds the lock)."""
        s = self.sessions
        if s.state in NOT_LIVE_CHECKED:
            if s.state in (State.JOINING, State.STALE):
                return f"what is served is not the fleet's version (the engine is {s.state.value})"
            return f"an update session is open (the engine is {s.state.value})"
        if s.dirty:
            return "the weights are dirty: nothing is served until a session publishes"
        return ""

    def check(self) -> dict[str, Any]:
        """Compare the served weights with the reference now (take the reference when the published
        weights have none yet). Returns what it found: ``checked``, ``match``, ``mismatched`` (up to
        20 ``rank R: name``), ``reference`` (``taken`` or ``compared``), or ``reason`` when it
        checked nothing."""
        sessions = self.sessions
        with sessions.lock:
            why = self._checkable()
            epoch = sessions.publications
        if why:
            return {"checked": False, "reason": why}
        return sessions.scheduler.call(lambda: self._job(epoch), "live weights check")

    def _job(self, epoch: int) -> dict[str, Any]:
        """On the driver thread: digests of every rank, then the decision (no batch in between)."""
        sessions = self.sessions
        sums = sessions.driver.run(Op.LIVE_DIGEST, seed=self.seed)
        self._last = time.monotonic()
        with sessions.lock:
            why = self._checkable() or ("weights were published meanwhile" if sessions.publications != epoch else "")
            if why:
                return {"checked": False, "reason": why}
            if self.epoch != epoch or self.reference is None:
                self.reference, self.epoch = sums, epoch
                return {"checked": True, "match": True, "reference": "taken", "weight_version": sessions.weight_version}
            self.checks += 1
            bad = [f"rank {r}: {name}" for r, (got, want) in enumerate(zip(sums, self.reference, strict=True))
                   for name in sorted(set(got) | set(want)) if got.get(name) != want.get(name)]
            if bad:
                self.found += 1
                sessions.foreign_write(f"{len(bad)} tensor(s) differ from the publication's, e.g. {', '.join(bad[:3])}")
            return {"checked": True, "match": not bad, "mismatched": bad[:20], "reference": "compared",
                    "weight_version": sessions.weight_version, "weights_dirty": sessions.dirty}

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            with self.sessions.lock:
                due = self.sessions.publications != self.epoch or (
                    self.interval_s > 0 and time.monotonic() - self._last >= self.interval_s)
                due = due and not self._checkable()
            if not due:
                continue
            try:
                self.check()
            except Exception as exc:  # the engine is stopping or faulted; the scheduler says so elsewhere
                logger.warning("live weights check failed: %s", exc)
                self._last = time.monotonic()
