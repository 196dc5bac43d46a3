"""The engine's states and what moves it between them, written once, as data: :data:`TRANSITIONS`.

One :class:`Rule` per (states, event, condition), tried in order: the next state, or a refusal
(the exception, its HTTP status and message), and what else happens. The engine's update sessions
(:class:`~weightsync.engine.session.UpdateSessions`) decide every transition and every refusal by
looking the event up here (:func:`decide`) and change the state only through the rule found;
docs/engine.md, "States", is this table as :func:`states_markdown` renders it
(tests/test_structure_engine_states.py keeps the two equal and checks that every state answers
every event under every condition).

A new way to update (a shadow copy written while generation goes on, published by a flip at a
batch boundary) is new events and rows here, and a method of the sessions that looks them up.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from weightsync.engine.scheduler import Unavailable


class Conflict(Exception):
    """The call conflicts with the engine's state (HTTP 409); the message says what to do."""

    http_status: ClassVar[int] = 409


class OutsideSession(ValueError):
    """A weight write outside ``begin_weight_update ... end_weight_update`` (HTTP 400, as sglang)."""

    http_status: ClassVar[int] = 400


class State(enum.StrEnum):
    SERVING = "serving"
    PAUSED = "paused"
    UPDATING = "updating"
    """A session is open: writes are accepted."""
    ENDED = "ended"
    """A session ended (post-load done) and waits for its holder to publish a version."""


class Event(enum.StrEnum):
    """What happens to the engine: a call (by its route) or an outcome."""

    GENERATE = "generate"
    PAUSE = "pause_generation"
    CONTINUE = "continue_generation"
    BEGIN = "begin_weight_update"
    BEGIN_FAILED = "begin fails on a rank"
    WRITE = "update_weights_from_*"
    """``update_weights_from_distributed``, ``_tensor``, ``_disk``."""
    RESET = "weights_checker reset_tensors"
    END = "end_weight_update"
    VERSION = "update_weight_version"
    ABORT = "abort_weight_update"


class When(enum.StrEnum):
    """The condition a rule depends on, in the words the docs use."""

    ALWAYS = ""
    DIRTY = "dirty"
    GENERATING = "generation in progress"
    """A batch runs, or queued requests can run."""
    BATCH_RUNNING = "a batch is running"
    NOTHING_WRITTEN = "nothing written, nothing writable"
    """No update call or reset wrote in the session, and no sender can write the memory (no p2p)."""
    VERSION_GIVEN = "a version was given"
    """``update_weight_version`` inside the session, or an update call's ``weight_version``."""


@dataclass(frozen=True, slots=True)
class Facts:
    """What the conditions of :data:`TRANSITIONS` are evaluated on."""

    dirty: bool
    generating: bool
    running: bool
    wrote: bool
    writable: bool
    version_given: bool


HOLDS: dict[When, Callable[[Facts], bool]] = {
    When.ALWAYS: lambda f: True,
    When.DIRTY: lambda f: f.dirty,
    When.GENERATING: lambda f: f.generating,
    When.BATCH_RUNNING: lambda f: f.running,
    When.NOTHING_WRITTEN: lambda f: not (f.wrote or f.writable),
    When.VERSION_GIVEN: lambda f: f.version_given,
}


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the state machine: in ``states``, on ``event``, when ``when`` holds."""

    states: tuple[State, ...]
    event: Event
    then: State | None
    """The next state; None: unchanged."""
    when: When = When.ALWAYS
    refuse: type[Exception] | None = None
    """Refused with this exception (nothing changes); its ``http_status`` is the answer's."""
    why: str = ""
    """The refusal's message (``{version}``, ``{state}`` and ``{what}`` are filled in)."""
    note: str = ""
    """What else happens, or why it is refused when the message alone does not say (for the docs)."""


S, P, U, E = State.SERVING, State.PAUSED, State.UPDATING, State.ENDED
DIRTY_WHY = ("the engine's weights are dirty (reset, or partly written by an update that was not published) and no "
             "update is in progress: nothing is served until an update session writes, verifies and publishes them "
             "(weight version still {version!r})")
PAUSE_FIRST = "; call /pause_generation first"

TRANSITIONS: tuple[Rule, ...] = (
    Rule((S, P), Event.GENERATE, None, When.DIRTY, Unavailable, DIRTY_WHY,
         note="dirty weights are never served; queued requests too are answered so"),
    Rule((S,), Event.GENERATE, None, note="runs in the next batch"),
    Rule((P,), Event.GENERATE, None, note="queued until continue_generation"),
    Rule((U, E), Event.GENERATE, None, note="queued; runs after the publication and continue_generation"),
    Rule((S,), Event.PAUSE, P, note="the running batch stops: abort ends it and the queued requests; retract and "
                                    "in_place requeue its unfinished requests with their tokens"),
    Rule((P, U, E), Event.PAUSE, None, note="the same stop; the state is kept"),
    Rule((U,), Event.CONTINUE, None, refuse=Conflict,
         why="a weight update is in progress; call /end_weight_update first"),
    Rule((E,), Event.CONTINUE, None, refuse=Conflict,
         why="the weight update ended but was not published: verify it and call /update_weight_version (or "
             "/abort_weight_update) first"),
    Rule((S, P), Event.CONTINUE, None, When.DIRTY, Conflict, DIRTY_WHY,
         note="dirty weights are never served: a session must write, verify and publish first"),
    Rule((S, P), Event.CONTINUE, S, note="queued requests run"),
    Rule((U,), Event.BEGIN, None, refuse=Conflict,
         why="a weight update is already in progress (begin_weight_update was called); end or abort it first"),
    Rule((S,), Event.BEGIN, None, When.GENERATING, Conflict, "begin_weight_update while generation is in progress"
         + PAUSE_FIRST),
    Rule((S,), Event.BEGIN, None, refuse=Conflict, why="begin_weight_update needs a paused engine" + PAUSE_FIRST),
    Rule((P, E), Event.BEGIN, None, When.BATCH_RUNNING, Conflict, "begin_weight_update while a batch is running"
         + PAUSE_FIRST),
    Rule((P,), Event.BEGIN, U, note="a new session, its id in the answer; dirty from here on where senders write the "
                                    "served memory (p2p, not staged)"),
    Rule((E,), Event.BEGIN, U, note="a new session replaces the unpublished one (recovery); dirty as above"),
    Rule((U,), Event.BEGIN_FAILED, P, note="no session; dirty as it was"),
    Rule((U,), Event.WRITE, None, note="the session wrote; dirty (staged shm: at end); a weight_version given is the "
                                       "version end publishes"),
    Rule((S, P, E), Event.WRITE, None, refuse=OutsideSession,
         why="{what} must run between begin_weight_update() and end_weight_update() (the engine is {state}); pause, "
             "begin, write, end", note="a write outside a session (sglang 0.5.23's rule too); nothing is written"),
    Rule((S, P, U, E), Event.RESET, None, When.GENERATING, Conflict, "reset_tensors while generation is in progress"
         + PAUSE_FIRST),
    Rule((S,), Event.RESET, P, note="dirty; queued requests answered 503"),
    Rule((U,), Event.RESET, None, note="dirty; the session wrote"),
    Rule((P, E), Event.RESET, None, note="dirty (paused: queued requests answered 503)"),
    Rule((S, P, E), Event.END, None, refuse=Conflict, why="no weight update in progress; call /begin_weight_update "
                                                          "first"),
    Rule((U,), Event.END, P, When.NOTHING_WRITTEN, note="post-load; nothing to publish: the session closes, dirty "
                                                        "stays dirty"),
    Rule((U,), Event.END, P, When.VERSION_GIVEN, note="post-load (a staged inbox copied in first); the session's "
                                                      "version is published: clean"),
    Rule((U,), Event.END, E, note="post-load (a staged inbox copied in first); dirty, awaiting publication"),
    Rule((U,), Event.VERSION, None, note="the version end publishes (effect pending)"),
    Rule((E,), Event.VERSION, P, note="the publication: clean at the version (effect published)"),
    Rule((S, P), Event.VERSION, None, When.DIRTY, Conflict, DIRTY_WHY,
         note="a label cannot clean dirty weights: only a session's publication does"),
    Rule((S, P), Event.VERSION, None, note="a new label of the clean weights (effect labelled)"),
    Rule((S, P), Event.ABORT, None, refuse=Conflict, why="no weight update session to abort"),
    Rule((U, E), Event.ABORT, P, note="the session closes unpublished: old version, dirty if anything reached the "
                                      "served weights (then queued requests are answered 503)"),
)
"""The engine's state machine (module docstring): for an event, the first rule whose states hold
the engine's state and whose condition holds is the one that applies."""


def decide(state: State, event: Event, facts: Facts) -> Rule:
    """The rule of :data:`TRANSITIONS` for ``event`` in ``state`` under ``facts``.

    Raises:
        LookupError: no rule applies (the table is incomplete: a bug).
    """
    for rule in TRANSITIONS:
        if rule.event is event and state in rule.states and HOLDS[rule.when](facts):
            return rule
    raise LookupError(f"no rule for {event} in state {state} ({facts})")


def states_markdown() -> str:
    """:data:`TRANSITIONS` as the Markdown table of docs/engine.md, "States"."""
    lines = ["| state | event | when | next | what happens |", "| --- | --- | --- | --- | --- |"]
    for r in TRANSITIONS:
        then = (f"refused ({r.refuse.http_status})" if r.refuse is not None  # type: ignore[attr-defined]
                else r.then.value if r.then is not None else "(unchanged)")
        lines.append(f"| {', '.join(s.value for s in r.states)} | `{r.event.value}` | {r.when.value} | {then} | "
                     f"{r.note or r.why} |")
    return "\n".join(lines) + "\n"
