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
the run. Nothing is restarted when no engine is left healthy to join from.

An engine that dies while the step generates or is validated (:meth:`EngineReplacer.call_each`:
its generation or its checksum / logprob call fails, and the engine is then found dead) is
replaced the same way once the other engines' calls are answered, and that one call is sent again,
once, to its replacement: the step's samples (or checks) are complete, and the record says
``during``. A second failure stops the run naming both causes; a call that fails on an engine that
still serves is not retried (it stops the run, as without the option). Calls of the update itself
are not retried: an engine failing in it is dropped, and replaced before the step is validated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from weightsync.launch.placement import EngineHandle, Placement
from weightsync.launch.procs import health_cause
from weightsync.sync.engine_client import EngineError

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

    def replace_dead(self, step: int, version: str, before: str, *, dead: dict[int, str] | None = None,
                     during: bool = False) -> list[dict[str, Any]]:
        """Replace every dead engine (module docstring); the replacements' records, ``[]`` when
        every engine serves. The caller then has the trainer ranks refresh their updaters.

        Args:
            step: the step about to run its ``before`` (``generate``, ``update``, ``validate``).
            version: the weight version the engines serve now (the replacements must serve it).
            dead: the dead engines when the caller found them already (default: looked up here).
            during: they died during ``before`` (:meth:`call_each`), not before it.

        Raises:
            ReplaceError: a dead engine this run did not start, none left healthy to join from, or
                a replacement that did not serve ``version`` (both causes named).
        """
        dead = self.dead() if dead is None else dead
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
                      "serve_s": round(serve_s, 3), "peer": peer, "during": during}
            self.say(f"replaced engine {i} {'during' if during else 'before'} step {step}'s {before}: {why}; "
                     f"its replacement serves version "
                     f"{version} {serve_s:.1f} s after its start, joined from {peer}")
            records.append(record)
        return records

    def call_each(self, step: int, version: str, what: str, call: Callable[[int], Any],
                  rejoined: Callable[[list[dict[str, Any]]], None]) -> tuple[list[Any], list[dict[str, Any]]]:
        """``call(i)`` on every engine ``i`` at once; an engine whose call failed because it died
        is replaced (:meth:`replace_dead`, then ``rejoined(records)`` re-reads the engines) and its
        call is sent once more, to the replacement. Returns every engine's answer and the
        replacements' records.

        Args:
            step, version: as :meth:`replace_dead`'s; ``what``: the step's part (``generate``,
                ``validate``) that the records name.
            call: one engine's call, by index (it reads the engine's current handle or client).

        Raises:
            EngineError: a call failed on an engine that serves (it was not a death).
            ReplaceError: a dead engine could not be replaced (:meth:`replace_dead`), or its call
                failed again on the replacement (both causes named).
        """
        found = [self.procs.submit(call, i) for i in range(len(self.procs.engines))]
        outs: list[Any] = []
        failed: dict[int, EngineError] = {}
        for i, f in enumerate(found):
            try:
                outs.append(f.result())
            except EngineError as exc:
                outs.append(None)
                failed[i] = exc
        if not failed:
            return outs, []
        dead = self.dead()
        if served := [i for i in failed if i not in dead]:
            raise failed[served[0]]
        records = self.replace_dead(step, version, what, dead=dead, during=True)
        rejoined(records)
        for i, exc in failed.items():
            try:
                outs[i] = call(i)
            except EngineError as again:
                raise ReplaceError(f"{dead[i]}, failing step {step}'s {what} ({exc}); sent again to its replacement, "
                                   f"it failed too: {again}") from again
        return outs, records

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
