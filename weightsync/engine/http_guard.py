"""The engine's HTTP connections, bounded: a cap below the process's descriptor limit, a deadline to
receive each request, and stalled connections evicted before anyone else.

uvicorn (with h11) never times out a request that is being received: a client that opens a
connection and sends half its headers, or its headers and then a trickle of body, holds a
descriptor forever; 1,100 such connections against a 1,024-descriptor limit left the engine unable
to accept anyone (its ``accept`` failing with EMFILE). Here every connection is one of
:class:`GuardedH11Protocol`, which tells its :class:`ConnectionGuard` when it is *receiving* -- from
the connection's start, or the first byte of a request, until the request's last byte -- and the
guard:

* closes a connection whose headers have not all arrived within ``header_timeout_s`` of its start
  (or of its request's first byte), or whose body has not within ``body_timeout_s`` (answering
  ``408`` when no request is under way); while the engine itself stops reading a body (flow
  control: its app waits for room to parse it), the clock waits too;
* holds at most ``max_connections``, kept below the descriptor limit by more than the accept
  backlog (so that ``accept`` never fails): a connection beyond the cap evicts the one that has
  been receiving the longest, else an idle keep-alive one; when every connection is waiting for its
  answer the new one is refused (``503``). A legitimate client sends its request at once, so only
  stalled connections are evicted.

The token is the next check (the app's middleware, on the headers, before any body byte is read);
idle keep-alive connections close after uvicorn's ``timeout_keep_alive``.

The bodies themselves are read and parsed within a budget (:mod:`weightsync.engine.http_body`).
On SIGTERM or Ctrl-C the server (:class:`StoppingServer`) tells the engine's scheduler at once, so
that requests waiting on it end instead of holding the shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 2048
ACCEPT_BACKLOG = 128
"""The listening socket's backlog, which is also how many connections asyncio accepts at once before
any of them reaches the guard: part of :data:`FD_RESERVE`."""
FD_RESERVE = 256
"""Descriptors kept below the limit: a burst of :data:`ACCEPT_BACKLOG` accepted connections, and the
engine's own (its ranks' sockets, shm segments, logs)."""
SWEEP_S = 0.5
"""How often expired reads are looked for."""

_RECEIVED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR, h11.SWITCHED_PROTOCOL)
"""The client's h11 states in which its request has arrived whole (or it is gone)."""


def _answer(status: str, text: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection."""
    body = text.encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: {len(body)}\r\n"
            f"\r\n").encode() + body


_TIMEOUT = _answer("408 Request Timeout", "request not received in time\n")
_FULL = _answer("503 Service Unavailable", "too many connections; retry later\n")


def connection_cap(requested: int) -> int:
    """``requested``, lowered to leave :data:`FD_RESERVE` descriptors below this process's soft
    descriptor limit (raised to its hard limit first, as servers do)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, soft - FD_RESERVE))


class ConnectionGuard:
    """The cap and the read deadlines of one server's connections (module docstring)."""

    def __init__(self, *, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.connections: set[GuardedH11Protocol] = set()
        self.evicted = 0
        """Connections closed to make room for a new one."""
        self.expired = 0
        """Connections closed because their request did not arrive in time."""
        self.refused = 0
        """Connections refused at the cap (every other one was waiting for its answer)."""
        self._sweeping = False

    def protocol(self) -> Callable[..., GuardedH11Protocol]:
        """uvicorn's ``http`` protocol class (``uvicorn.Config(http=guard.protocol())``)."""
        return functools.partial(GuardedH11Protocol, guard=self)

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Take ``conn``; False when it was refused (the cap, and nobody to evict)."""
        if not self._sweeping:
            self._sweeping = True
            conn.loop.call_later(SWEEP_S, self._sweep, conn.loop)
        if len(self.connections) >= self.max_connections:
            victim = self._victim()
            if victim is None:
                self.refused += 1
                conn.transport.write(_FULL)
                conn.transport.close()
                return False
            self.evicted += 1
            victim.transport.close()
            self.connections.discard(victim)
        self.connections.add(conn)
        return True

    def forget(self, conn: GuardedH11Protocol) -> None:
        self.connections.discard(conn)

    def _victim(self) -> GuardedH11Protocol | None:
        """The connection that has been receiving the longest, else an idle one (None: all busy)."""
        receiving = [c for c in self.connections if c.receiving_since is not None]
        if receiving:
            return min(receiving, key=lambda c: c.receiving_since or 0.0)
        idle = [c for c in self.connections if c.idle()]
        return idle[0] if idle else None

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        for conn in list(self.connections):
            since = conn.receiving_since
            if since is None:
                continue
            if conn.flow is not None and conn.flow.read_paused:
                # the engine stopped reading (its app waits for room to parse the body): not the
                # client's delay; the deadline counts again from when reading resumes
                conn.receiving_since = now
                continue
            limit = self.header_timeout_s if conn.awaiting_headers() else self.body_timeout_s
            if now - since > limit:
                self.expired += 1
                conn.expire()
                self.connections.discard(conn)
        loop.call_later(SWEEP_S, self._sweep, loop)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, telling its guard when it is receiving a request."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.receiving_since: float | None = None
        """When the request being received began (its headers are due from the connection's start);
        None once it arrived whole."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.receiving_since = time.monotonic()
        if not self.guard.admit(self):
            self.connections.discard(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.receiving_since is None:
            self.receiving_since = time.monotonic()
        super().data_received(data)
        if self.conn.their_state in _RECEIVED:
            self.receiving_since = None

    def awaiting_headers(self) -> bool:
        """The request's headers have not all arrived."""
        return self.conn.their_state is h11.IDLE

    def idle(self) -> bool:
        """Between requests: nothing being received, no answer owed."""
        return self.receiving_since is None and (self.cycle is None or self.cycle.response_complete)

    def expire(self) -> None:
        """Close a connection whose request did not arrive in time (408 when no request is under way)."""
        logger.info("closing connection from %s: its request did not arrive in time", self.client)
        if self.awaiting_headers() and not self.transport.is_closing():
            self.transport.write(_TIMEOUT)
        self.transport.close()



class StoppingServer(uvicorn.Server):
    """uvicorn's server, which tells the scheduler at once that the engine stops (SIGTERM, Ctrl-C):
    calls still waiting on it (a weight-update group join, up to its deadline) end now instead of
    holding the shutdown, which waits for every request's thread."""

    def __init__(self, scheduler: Any, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.scheduler.begin_stop()
        super().handle_exit(sig, frame)
