"""A request's body, read and validated within bounds: at most the route's size, the bodies being
parsed at once within a budget (:class:`BodyBudget`), and a client that goes away mid-body a 400.

Parsing a JSON body costs several times its size (a list of token ids as Python objects: about
8 times) and holds the interpreter while it runs (about 50 ms per MB), so the bodies being read
and parsed at once hold a share of a :class:`BodyBudget` (their declared length, or the limit
when undeclared); one that does not fit waits, at most ``wait_s``, then is answered 503: the
memory of every parse in flight stays within a multiple of the budget, however many clients send
at once. A body that does not validate is a :class:`BadBody` naming every field in question
(sglang's ``ErrorResponse``, 400).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import ClassVar, TypeVar

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from weightsync.engine.io_base import RequestBody, TooLarge

B = TypeVar("B", bound=RequestBody)
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
DEFAULT_WAIT_S = 60.0


class BadBody(ValueError):
    """A request body that does not validate (HTTP 400, sglang's ``ErrorResponse``)."""


class Busy(Exception):
    """The engine is parsing as many bodies as its budget holds (HTTP 503; retry)."""

    http_status: ClassVar[int] = 503


class BodyBudget:
    """Bytes of request bodies read and parsed at once: at most ``capacity`` (module docstring)."""

    def __init__(self, capacity: int, wait_s: float = DEFAULT_WAIT_S) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.used = 0
        self._cond: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` (at most the capacity) of the budget for the block.

        Raises:
            Busy: no room within ``wait_s``.
        """
        nbytes = min(nbytes, self.capacity)
        if self._cond is None:
            self._cond = asyncio.Condition()
        cond = self._cond
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self.used + nbytes <= self.capacity), self.wait_s)
            except TimeoutError:
                raise Busy(f"the engine is parsing {self.used} bytes of request bodies, its budget is {self.capacity}; "
                           "retry") from None
            self.used += nbytes
        try:
            yield
        finally:
            async with cond:
                self.used -= nbytes
                cond.notify_all()


_TYPE_TAG = re.compile(r"^([A-Z]\w*|str|int|float|bool|none|(list|dict|tuple|literal)\[.*\]|function-\w+.*)$")
"""Union-branch and validator tags pydantic puts into an error's location (not field names)."""


def _describe(exc: ValidationError, model: type[RequestBody]) -> str:
    """One line per problem; unknown fields say so plainly (sglang would drop them silently)."""
    seen: list[str] = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if not _TYPE_TAG.match(str(x)))
        if e.get("type") == "extra_forbidden":
            msg = f"{loc}: unknown field (not a field of sglang's {model.__name__}; check its spelling)"
        else:
            msg = f"{loc}: {e.get('msg')}" if loc else str(e.get("msg"))
        if msg not in seen:
            seen.append(msg)
    return "invalid request: " + "; ".join(seen)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read at most ``limit`` bytes far.

    Raises:
        TooLarge: the body is longer.
        BadBody: the client went away before its body arrived.
    """
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"request body over {limit} bytes (the engine's max_request_bytes)")
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-body (or closed by the connection guard's deadline)
        raise BadBody("the client closed the connection before its body arrived") from None
    return b"".join(chunks)


async def parse_body(request: Request, model: type[B], limit: int = DEFAULT_MAX_REQUEST_BYTES,
                     budget: BodyBudget | None = None) -> B:
    """The request's JSON body as ``model``; an absent body is ``{}`` (every field's default). While
    it is read and parsed it holds its share of ``budget`` (:class:`~weightsync.engine.http_guard.BodyBudget`).

    Raises:
        Busy: no room in the budget in time.
        BadBody: malformed JSON, a body that does not validate (the message names the fields), or
            the client went away before its body arrived.
        TooLarge: a body over ``limit`` bytes.
    """
    declared = request.headers.get("content-length", "")
    async with (budget.hold(int(declared) if declared.isdigit() else limit) if budget is not None
                else contextlib.nullcontext()):
        return _validate(await read_body(request, limit), model)


def _validate(raw: bytes, model: type[B]) -> B:
    try:
        return model.model_validate_json(raw if raw.strip() else b"{}")
    except ValidationError as exc:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise BadBody(f"invalid request: malformed JSON body ({exc.errors()[0].get('msg')})") from None
        raise BadBody(_describe(exc, model)) from None
