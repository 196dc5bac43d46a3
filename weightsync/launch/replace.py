"""``run --replace-dead-engines``: an engine the run started that died is started again and rejoins.

Before each step's generation and update (and before its validation, where the update dropped an
engine), :meth:`EngineReplacer.replace_dead` looks at every engine: its process exited, or its
``/health`` fails. Each dead one that this run started is stopped for good (a hung process is
killed) and started again by the placement where it served -- the same host, port and GPU, the
same command line -- plus ``--join-from`` the engines that are healthy: it copies the fleet's
current version from the first of them that can give it, verified, before it serves
(:mod:`weightsync.engine.join`). The launcher waits until it serves the run's current version
(its generation answers 503 until then, so no step generates on it before), then every trainer
rank's updater re-reads the engines (:class:`~weightsync.launch.messages.Refresh`): the next
update writes the replacement like any other engine.

One line is printed per replacement: which engine, why it died, how long its replacement took to
serve the current version and which peer gave it; each is kept in the step's record
(``replacements``) and ``results.json``'s summary. A replacement that does not serve (it exits,
its join fails on every peer, the engine start deadline passes) stops the run, naming both
causes. Engines the run did not start (``--engine-urls``) are never restarted: a dead one stops
the run. Nothing is restarted when no engine is left healthy to join from. An engine that dies
while the step generates or is validated still stops the run: those calls are not retried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from weightsync.launch.placement import EngineHandle, Placement
from weightsync.launch.procs import health_cause

JOIN_FLAG = "--join-from"
POLL_S = 0.2


class ReplaceError(RuntimeError):
    """A dead engine could not be replaced (the message names its cause and the replacement's)."""


class EngineReplacer:
    """Finds the run's dead engines and replaces them (module docstring)."""

    def __init__(self, procs: Placement, *, timeout_s: float, say: Callable[[str], None] = print) -> None:
        """Args:
            procs: the run's placement (it started the engines, it starts their replacements).
            timeout_s: how long a replacement may take to serve the current version.
            say: where the line of each replacement goes.
        """
        self.procs = procs
        self.timeout_s = timeout_s
        self.say = say

    def dead(self) -> dict[int, str]:
        """The engines that cannot serve now, by index, with why (the engine's own diagnosis)."""

        def why(e: EngineHandle) -> str:
            if e.alive() and e.client.health()[0] == 200:
                return ""
            return e.diagnose() or health_cause(e.client, f"engine {e.index} ({e.url})") or \
                f"engine {e.index} ({e.url}) does not serve"

        found = [self.procs.submit(why, e) for e in self.procs.engines]
        return {e.index: w for e, f in zip(self.procs.engines, found, strict=True) if (w := f.result())}

    def replace_dead(self, step: int, version: str, before: str) -> list[dict[str, Any]]:
        """Replace every dead engine (module docstring); the replacements' records, ``[]`` when
        every engine serves. The caller then has the trainer ranks refresh their updaters.

        Args:
            step: the step about to run its ``before`` (``generate``, ``update``, ``validate``).
            version: the weight version the engines serve now (the replacements must serve it).

        Raises:
            ReplaceError: a dead engine this run did not start, none left healthy to join from, or
                a replacement that did not serve ``version`` (both causes named).
        """
        dead = self.dead()
        if not dead:
            return []
        attached = [why for i, why in dead.items() if not self.procs.launched(i)]
        if attached:
            raise ReplaceError("; ".join(attached) + " (an engine this run did not start is never restarted)")
        peers = [e.url for e in self.procs.engines if e.index not in dead]
        if not peers:
            raise ReplaceError("; ".join(dead.values()) + ": no engine is left healthy to join from")
        started: dict[int, float] = {}
        for i in dead:
            started[i] = time.monotonic()
            self.procs.replace_engine(i, [JOIN_FLAG, ",".join(peers)])
        records = []
        for i, why in dead.items():
            serve_s, peer = self._wait_serving(self.procs.engines[i], version, started[i], why)
            record = {"engine": i, "step": step, "before": before, "cause": why, "version": version,
                      "serve_s": round(serve_s, 3), "peer": peer}
            self.say(f"replaced engine {i} before step {step}'s {before}: {why}; its replacement serves version "
                     f"{version} {serve_s:.1f} s after its start, joined from {peer}")
            records.append(record)
        return records

    def _wait_serving(self, e: EngineHandle, version: str, t0: float, cause: str) -> tuple[float, str]:
        """Seconds from the replacement's start until it serves ``version``, and its peer.

        Raises:
            ReplaceError: it exited, its join failed or the deadline passed (``cause`` first).
        """
        end = t0 + self.timeout_s
        state: dict[str, Any] = {}
        while time.monotonic() < end:
            if not e.alive():
                log = self.procs.engine_log(e.index, self.procs.replaced(e.index))
                raise ReplaceError(f"{cause}; its replacement did not serve: {e.diagnose() or 'it exited'}\n"
                                   f"--- replacement log ({log}) ---\n{e.tail()}")
            status, state = e.client.health()
            if status == 200 and state.get("state") == "serving" and str(state.get("weight_version")) == version:
                served = time.monotonic() - t0
                join = (e.client.server_info().get("internal_states") or [{}])[0].get("last_join") or {}
                return served, str(join.get("peer") or "a peer")
            if status == 200 and state.get("state") == "stale":  # the join failed on every peer
                raise ReplaceError(f"{cause}; its replacement did not join version {version}: "
                                   f"{state.get('reason') or state}")
            time.sleep(POLL_S)
        raise ReplaceError(f"{cause}; its replacement did not serve version {version} within {self.timeout_s:g} s "
                           f"(the engine start deadline, run --deadlines engine_start=SECONDS; last /health: {state})")


__all__ = ["EngineReplacer", "ReplaceError"]
