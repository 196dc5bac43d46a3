"""Who takes part in an update: the engine registry, and the engines of one attempt.

A fleet changes while it trains: engines fail, are replaced, are added. Two small records say who
serves and who takes part:

* :class:`EngineRegistry` -- the engines that serve (base URLs), fed by whoever starts them (the
  launcher, a user's own scheduler); :meth:`WeightUpdater.refresh
  <weightsync.sync.updater.WeightUpdater.refresh>` reads it between updates;
* :class:`Participants` -- the engines of one update attempt, on rank 0: those of the plan less
  the excluded ones, less those that fail on the way. With ``UpdaterConfig.on_engine_failure``
  ``drop`` a failing engine is dropped from the attempt (its error kept) and the others go on;
  with ``abort`` the first failure ends the attempt on every engine.

Typical usage::

    registry = EngineRegistry(["http://10.0.0.5:30000", "http://10.0.0.6:30000"])
    updater = WeightUpdater(params, ..., engine_urls=registry, ...)
    registry.add("http://10.0.0.7:30000")      # a new or replacement engine
    updater.refresh()                          # planned to, brought up to date, in the next update
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from weightsync.sync.rank_group import from_rank0

if TYPE_CHECKING:  # the HTTP client (httpx) is imported only by an updater that drives engines
    from weightsync.sync.engine_client import EngineClient

T = TypeVar("T")
log = logging.getLogger(__name__)

PROBE_S = 5.0
"""How long a ``/health`` probe of an engine waits (after a failure; at ``refresh()``)."""


class FleetError(RuntimeError):
    """An attempt cannot go on: the policy is abort and an engine failed, or every engine failed."""

ON_ENGINE_FAILURE = ("auto", "drop", "abort")
"""``UpdaterConfig.on_engine_failure``: ``auto`` drops where more than one engine takes part."""


class EngineRegistry:
    """The engines that serve, as base URLs in the order they were added (thread-safe)."""

    def __init__(self, urls: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._urls: list[str] = []
        for u in urls:
            self.add(u)

    def add(self, url: str) -> None:
        """A new (or restarted) engine; adding one already there changes nothing."""
        url = url.rstrip("/")
        with self._lock:
            if url not in self._urls:
                self._urls.append(url)

    def remove(self, url: str) -> None:
        """An engine that no longer serves (gone for good; a restarted one is added again).

        Raises:
            KeyError: ``url`` is not registered.
        """
        url = url.rstrip("/")
        with self._lock:
            if url not in self._urls:
                raise KeyError(f"{url} is not a registered engine")
            self._urls.remove(url)

    def urls(self) -> list[str]:
        """The registered engines, now."""
        with self._lock:
            return list(self._urls)

    def __len__(self) -> int:
        return len(self.urls())


def drops(policy: str, num_engines: int) -> bool:
    """Whether ``policy`` (:data:`ON_ENGINE_FAILURE`) drops a failing engine from a fleet of
    ``num_engines`` (``auto``: drop with more than one)."""
    return policy == "drop" or (policy == "auto" and num_engines > 1)


class Participants:
    """The engines of one attempt (rank 0; module docstring)."""

    def __init__(self, engines: Any, excluded: Mapping[int, str], *, drop: bool) -> None:
        """Args:
            engines: the plan's :class:`~weightsync.sync.engines.Engines`.
            excluded: engines left out of this update (dropped earlier, not back yet), with why.
            drop: a failing engine is dropped (else the first failure raises).

        Raises:
            FleetError: every engine is excluded.
        """
        self.engines = engines
        self.drop_failed = drop
        self.active = [e for e in range(len(engines.clients)) if e not in excluded]
        self.dropped: dict[int, str] = {}
        """Engines dropped from this attempt, with the error that dropped them."""
        self.group_rebuild_s = 0.0
        """Seconds spent rebuilding broadcast's weight-update groups for the survivors (p2p: none)."""
        if not self.active:
            raise FleetError("no engine takes part: every one was dropped from an earlier update and has not "
                              "rejoined (" + "; ".join(excluded.values()) + ")")

    def each(self, fn: Callable[[EngineClient], T], *, what: str) -> dict[int, T]:
        """``fn(client)`` on every active engine; a failing one is dropped (:meth:`drop`).

        Returns:
            The surviving engines' results.
        """
        out, failed = self.engines.each_of(self.active, fn, what=what)
        self.drop(failed)
        return out

    def each_of(self, engines: Sequence[int], fn: Callable[[EngineClient], T], *, what: str) -> dict[int, T]:
        """``fn(client)`` on ``engines`` (a subset of the active ones), dropping those that fail."""
        out, failed = self.engines.each_of(engines, fn, what=what)
        self.drop(failed)
        return out

    def unreachable(self) -> dict[int, str]:
        """The active engines that do not answer ``/health`` now (after a failure nobody named)."""
        _, failed = self.engines.each_of(self.active, probe, what="/health")
        return failed

    def leave_dropped(self, version: str, wait_s: float) -> None:
        """The dropped engines' sessions aborted and each told it missed ``version`` (``/mark_stale``:
        it refuses ``/generate`` until it rejoins); best effort -- a dead engine answers neither."""
        if not self.dropped:
            return
        self.engines.abort_sessions(wait_s, list(self.dropped))
        _, failed = self.engines.each_of(list(self.dropped), lambda c: c.mark_stale(version), what="mark_stale")
        for why in failed.values():
            log.warning("a dropped engine was not marked stale: %s", why)

    def drop(self, failed: Mapping[int, str]) -> None:
        """Drop the engines of ``failed`` (index -> error) from this attempt.

        Raises:
            FleetError: the policy is abort (every error named), or no engine is left.
        """
        if not failed:
            return
        if not self.drop_failed:
            raise FleetError("; ".join(failed.values()))
        for e, why in failed.items():
            if e in self.active:
                self.active.remove(e)
                self.dropped[e] = why
        if not self.active:
            raise FleetError("every engine failed: " + "; ".join(self.dropped.values()))

    def ranks(self, tp: int) -> list[int]:
        """The active engines' rollout ranks (``tp`` per engine)."""
        return [e * tp + r for e in self.active for r in range(tp)]

    def skipped_ranks(self, tp: int) -> set[int]:
        """The rollout ranks of every engine not active."""
        return set(range(len(self.engines.clients) * tp)) - set(self.ranks(tp))

    def engines_of(self, ranks: Iterable[int], tp: int) -> list[int]:
        return sorted({r // tp for r in ranks})

    def urls(self) -> list[str]:
        """The active engines' base URLs."""
        return [self.engines.clients[e].base_url for e in self.active]


def probe(c: EngineClient) -> tuple[int, dict[str, Any]]:
    """``/health`` once (within :data:`PROBE_S`): its status and body (a real sglang server's: none).

    Raises:
        ConnectionError: the engine does not answer.
    """
    status, body = c.health(PROBE_S)
    if status is None:
        raise ConnectionError(f"{c.base_url}/health: no answer ({body.get('error', '')})")
    return status, body


JOIN_MISSING = (404, 405, 501)
"""Answers of an engine without ``/join_from_peer``: it is brought up to date by the next update."""

JOIN_POLL_S = 0.2
"""How often a joining engine's ``/health`` is read while :func:`survey` waits for it."""


class Roster:
    """Who serves and who takes part, across updates (every rank holds one; rank 0 asks the
    engines, :meth:`replan` shares what it found).

    * :attr:`fleet` -- every engine's URL, those planned for, those left out and the followers;
    * :attr:`excluded` -- engines planned for but left out of updates (dropped from one and not
      back yet), by index into the planned list, with why;
    * :attr:`followers` -- engines of another layout than the planned ones (another TP): the
      trainer does not write them; after each publication they join it from a peer that took
      part (:meth:`lead`), so they serve each version one peer copy after the others;
    * :attr:`published` -- the last version an update published.
    """

    def __init__(self, engine_urls: Sequence[str] | EngineRegistry | None) -> None:
        self.registry = engine_urls if isinstance(engine_urls, EngineRegistry) else None
        self.fleet: list[str] = list(engine_urls.urls() if self.registry else engine_urls or ())
        self.excluded: dict[int, str] = {}
        self.followers: list[str] = []
        self.published: str | None = None

    def published_by(self, version: str, dropped: Mapping[int, str]) -> None:
        """An update published ``version``; ``dropped`` (index -> why) did not take part."""
        self.excluded.update(dropped)
        self.published = version

    def replan(self, planned: Sequence[str], engine_urls: Sequence[str] | None, pg: Any,
               client: Callable[[str], EngineClient], join_timeout_s: float) -> list[str] | None:
        """Survey the fleet (``engine_urls``, else the registry's, else :attr:`fleet`) against
        the engines ``planned`` for now (:func:`survey`, on rank 0; collective over ``pg``).

        Returns:
            The engines to plan for, where they differ from ``planned`` (None: the same).

        Raises:
            FleetError: no engine answers.
        """
        fleet = list(engine_urls) if engine_urls is not None else self.registry.urls() if self.registry else \
            self.fleet
        out = {planned[e]: why for e, why in self.excluded.items()}
        out.update({u: "new" for u in fleet if u not in planned})
        now, left, followers = from_rank0(pg, lambda: survey(fleet, out, self.published, client, join_timeout_s))
        if not now:
            raise FleetError(f"no engine answers: {', '.join(fleet)}")
        self.fleet, self.followers = fleet, followers
        self.excluded = {now.index(u): why for u, why in left.items()}
        return None if now == list(planned) else now

    def lead(self, peers: Sequence[str], client: Callable[[str], EngineClient]) -> dict[str, str]:
        """Rank 0, after a publication by ``peers``: each follower starts joining it from them
        (``/join_from_peer``; this does not wait for the copy).

        Returns:
            The followers that could not be asked, with why (logged; asked again next time).
        """
        failed: dict[str, str] = {}
        for url in self.followers:
            c = client(url)
            try:
                c.join_from_peer(list(peers))
            except Exception as exc:  # gone, or still joining an older version: the next publication asks again
                failed[url] = f"{url}: /join_from_peer: {exc}"
                log.warning("follower %s did not start joining version %s: %s", url, self.published, exc)
            finally:
                c.close()
        return failed


def survey(fleet: Sequence[str], excluded: Mapping[str, str], published: str | None,
           client: Callable[[str], EngineClient], join_timeout_s: float
           ) -> tuple[list[str], dict[str, str], list[str]]:
    """Who takes part in the next update (rank 0, at ``refresh()``).

    An engine of ``fleet`` not in ``excluded`` takes part. An excluded one (dropped earlier, or
    new) is asked (:func:`rejoin`): unreachable -- left out of the plan until it answers; serving
    ``published`` -- back; otherwise it joins from the engines that take part
    (``/join_from_peer``: copied and verified from a peer) and is back once it serves
    ``published``; a failed join, or an engine without that route, is back too (the next update
    writes all of it); one still joining after ``join_timeout_s`` is planned for but left out of
    updates until a later ``refresh()`` finds it serving. A new engine of another layout than
    those that take part (``/server_info``'s sizes) joins the same way but is a follower: never
    planned for (:class:`Roster`).

    Args:
        fleet: every engine's URL, in order.
        excluded: URL -> why it is out (from an earlier update's drop, or new).
        published: the version the fleet serves (None: nothing published yet).
        client: an engine client for a URL (closed here).
        join_timeout_s: how long to wait for each join.

    Returns:
        The engines planned for (URLs, ``fleet``'s order), those among them left out (with why),
        and the followers.
    """
    peers = [u for u in fleet if u not in excluded]
    planned: list[str] = []
    out: dict[str, str] = {}
    followers: list[str] = []
    sizes: dict[str, Any] = {}
    for url in fleet:
        if url not in excluded:
            planned.append(url)
            continue
        c = client(url)
        try:
            follows = bool(peers) and _sizes(client, peers[0], sizes) != _sizes(client, url, sizes)
            why = rejoin(c, peers, published, join_timeout_s)
        except Exception as exc:  # unreachable: not planned for until it answers
            log.warning("%s is not back (%s): left out of the plan", url, exc)
            continue
        finally:
            c.close()
        if follows:
            log.info("%s has another layout (%s) than the planned engines (%s): it follows them by peer joins",
                     url, sizes[url], sizes[peers[0]])
            followers.append(url)
            continue
        planned.append(url)
        if why is not None:
            out[url] = why
    return planned, out, followers


def _sizes(client: Callable[[str], EngineClient], url: str, known: dict[str, Any]) -> Any:
    """``url``'s engine's parallel sizes (``/server_info``; cached in ``known``)."""
    from weightsync.sync.engines import rollout_from_server_info  # httpx: only where engines are driven

    if url not in known:
        c = client(url)
        try:
            known[url] = rollout_from_server_info(c.server_info(), 1)
        finally:
            c.close()
    return known[url]


def rejoin(c: EngineClient, peers: Sequence[str], published: str | None, timeout_s: float) -> str | None:
    """Bring ``c``'s engine to ``published`` from ``peers`` (:func:`survey`).

    Returns:
        Why it stays out of the next update (None: it takes part).

    Raises:
        ConnectionError, EngineError: it does not answer, or refuses the join.
    """
    from weightsync.sync.engine_client import EngineError  # httpx: only where engines are driven

    status, h = probe(c)
    if published is None or _serves(status, h, published) or not peers:
        return None
    if h.get("state") != "joining":
        try:
            c.join_from_peer(list(peers))
        except EngineError as exc:
            if exc.status in JOIN_MISSING:
                return None
            raise
    end = time.monotonic() + timeout_s
    while True:
        status, h = probe(c)
        if _serves(status, h, published):
            log.info("%s joined version %s from a peer", c.base_url, published)
            return None
        if h.get("state") != "joining":  # the join failed (stale): the next update writes all of it
            log.warning("%s: its join from %s failed (%s); the next update writes all of it", c.base_url,
                        ", ".join(peers), h.get("reason") or h.get("state"))
            return None
        if time.monotonic() > end:
            return f"{c.base_url}: still joining version {published} after {timeout_s:.0f} s ({h.get('reason', '')})"
        time.sleep(JOIN_POLL_S)


def _serves(status: int, health: Mapping[str, Any], version: str) -> bool:
    """Whether an engine's ``/health`` says it serves ``version`` (a real sglang server's, no body: no)."""
    return status == 200 and health.get("state") == "serving" and str(health.get("weight_version")) == version
