"""The engine's states and what moves it between them, written once, as data: :data:`TRANSITIONS`.

One :class:`Rule` per (states, event, condition), tried in order: the next state, or a refusal
(the exception, its HTTP status and message), and what else happens. The engine's update sessions
(:class:`~weightsync.engine.session.UpdateSessions`) decide every transition and every refusal by
looking the event up here (:func:`decide`) and change the state only through the rule found;
docs/engine.md, "States", is this table as :func:`states_markdown` renders it
(tests/test_structure_engine_states.py keeps the two equal and checks that every state answers
every event under every condition).

Two kinds of session share the table. One opened the sglang way (``begin_weight_update`` on a
paused engine) goes through ``updating`` and ``ended`` while generation waits. One opened
pause-free (``begin_weight_update`` with ``pause_free``, on an engine that holds a shadow copy of
its parameters) goes through ``shadow_updating`` and ``shadow_ended`` while the engine keeps
generating from its served copy; its publication is a flip at a step boundary.

Two states are about the fleet rather than a session. ``joining``: the engine copies the fleet's
current version from a peer engine (``serve --join-from``, ``/join_from_peer``), verifies it by
fingerprint and only then serves it (:mod:`weightsync.engine.join`). ``stale``: the engine was
dropped from an update (``/mark_stale``) and holds an older version than the one the fleet
published; it serves nothing until it rejoins from a peer or takes part in the next update.
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


class NotIdle(ValueError):
    """``release_memory_occupation`` while generating (HTTP 400 with sglang's message: sglang
    asserts the server is idle, paused waiting requests aside)."""

    http_status: ClassVar[int] = 400


class State(enum.StrEnum):
    SERVING = "serving"
    PAUSED = "paused"
    UPDATING = "updating"
    """A session is open, generation waits: writes are accepted."""
    ENDED = "ended"
    """A session ended (post-load done) and waits for its holder to publish a version."""
    SHADOW_UPDATING = "shadow_updating"
    """A pause-free session is open: writes go to the shadow, the engine generates from the served copy."""
    SHADOW_ENDED = "shadow_ended"
    """A pause-free session ended (post-load on the shadow done); the engine generates meanwhile."""
    JOINING = "joining"
    """The engine copies the fleet's current version from a peer into its shadow; it serves nothing."""
    STALE = "stale"
    """The engine missed a published update: it serves nothing until it rejoins."""


class Event(enum.StrEnum):
    """What happens to the engine: a call (by its route) or an outcome."""

    GENERATE = "generate"
    PAUSE = "pause_generation"
    CONTINUE = "continue_generation"
    BEGIN = "begin_weight_update"
    BEGIN_SHADOW = "begin_weight_update pause_free"
    """``begin_weight_update`` with ``pause_free`` (an extension)."""
    BEGIN_FAILED = "begin fails on a rank"
    WRITE = "update_weights_from_*"
    """``update_weights_from_distributed``, ``_tensor``."""
    LOAD = "update_weights_from_disk"
    RELEASE = "release_memory_occupation"
    RESUME = "resume_memory_occupation"
    RESET = "weights_checker reset_tensors"
    END = "end_weight_update"
    VERSION = "update_weight_version"
    ABORT = "abort_weight_update"
    FOREIGN_WRITE = "live weights changed outside a session"
    """The live check (:mod:`weightsync.engine.live_check`) found the served weights changed since
    their publication with no session open: a write nobody published (a transport's peer)."""
    MARK_STALE = "mark_stale"
    """The fleet tells the engine it was dropped from an update (an extension)."""
    JOIN = "join_from_peer"
    """``/join_from_peer`` or ``serve --join-from`` (an extension)."""
    JOINED = "join verified"
    """The copy from a peer landed and its fingerprints match: the engine flips it in."""
    JOIN_FAILED = "join fails on every peer"
    DONATE = "donate_weights"
    """A joining peer asks for this engine's served copy (an extension)."""


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
    NO_SHADOW = "no shadow copy"
    """The engine holds no shadow copy (``serve --shadow off``, or no memory for one)."""
    STALE = "stale"
    """The engine was marked stale and has published nothing since."""
    STALE_UNWRITTEN = "stale, nothing written, nothing writable"


@dataclass(frozen=True, slots=True)
class Facts:
    """What the conditions of :data:`TRANSITIONS` are evaluated on."""

    dirty: bool
    generating: bool
    running: bool
    wrote: bool
    writable: bool
    version_given: bool
    shadow: bool
    stale: bool = False


HOLDS: dict[When, Callable[[Facts], bool]] = {
    When.ALWAYS: lambda f: True,
    When.DIRTY: lambda f: f.dirty,
    When.GENERATING: lambda f: f.generating,
    When.BATCH_RUNNING: lambda f: f.running,
    When.NOTHING_WRITTEN: lambda f: not (f.wrote or f.writable),
    When.VERSION_GIVEN: lambda f: f.version_given,
    When.NO_SHADOW: lambda f: not f.shadow,
    When.STALE: lambda f: f.stale,
    When.STALE_UNWRITTEN: lambda f: f.stale and not (f.wrote or f.writable),
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
    """The refusal's message (``{version}``, ``{state}``, ``{what}`` and ``{reason}``, the joining or
    stale engine's reason, are filled in)."""
    note: str = ""
    """What else happens, or why it is refused when the message alone does not say (for the docs)."""


S, P, U, E = State.SERVING, State.PAUSED, State.UPDATING, State.ENDED
SU, SE = State.SHADOW_UPDATING, State.SHADOW_ENDED
J, T = State.JOINING, State.STALE
DIRTY_WHY = ("the engine's weights are dirty (reset, partly written by an update that was not published, or stale) "
             "and no update is in progress: nothing is served until an update session writes, verifies and "
             "publishes them (weight version still {version!r})")
PAUSE_FIRST = "; call /pause_generation first"
IN_PROGRESS = "a weight update is already in progress (begin_weight_update was called); end or abort it first"
JOINING_WHY = "{reason}; wait until it serves (GET /health)"
STALE_WHY = "{reason}; rejoin first (/join_from_peer) or take part in the next update"

TRANSITIONS: tuple[Rule, ...] = (
    Rule((J,), Event.GENERATE, None, refuse=Unavailable, why="{reason}",
         note="nothing is served before the copy from a peer is verified and flipped in; queued requests too"),
    Rule((T,), Event.GENERATE, None, refuse=Unavailable, why="{reason}",
         note="an older version than the fleet's is never served; queued requests too"),
    Rule((S, P, SU, SE), Event.GENERATE, None, When.DIRTY, Unavailable, DIRTY_WHY,
         note="dirty weights are never served; queued requests too are answered so"),
    Rule((S,), Event.GENERATE, None, note="runs in the next batch"),
    Rule((P,), Event.GENERATE, None, note="queued until continue_generation"),
    Rule((U, E), Event.GENERATE, None, note="queued; runs after the publication and continue_generation"),
    Rule((SU, SE), Event.GENERATE, None, note="runs in the next batch, from the served copy"),
    Rule((S,), Event.PAUSE, P, note="the running batch stops: abort ends it and the queued requests; retract and "
                                    "in_place requeue its unfinished requests with their tokens"),
    Rule((SU,), Event.PAUSE, U, note="the same stop; the pause-free session goes on with generation paused"),
    Rule((SE,), Event.PAUSE, E, note="the same stop; the ended pause-free session waits paused"),
    Rule((P, U, E), Event.PAUSE, None, note="the same stop; the state is kept"),
    Rule((J, T), Event.PAUSE, None, note="nothing runs; the state is kept"),
    Rule((J,), Event.CONTINUE, None, refuse=Conflict, why=JOINING_WHY),
    Rule((T,), Event.CONTINUE, None, refuse=Conflict, why=STALE_WHY),
    Rule((U,), Event.CONTINUE, None, refuse=Conflict,
         why="a weight update is in progress; call /end_weight_update first"),
    Rule((E,), Event.CONTINUE, None, refuse=Conflict,
         why="the weight update ended but was not published: verify it and call /update_weight_version (or "
             "/abort_weight_update) first"),
    Rule((S, P), Event.CONTINUE, None, When.DIRTY, Conflict, DIRTY_WHY,
         note="dirty weights are never served: a session must write, verify and publish first"),
    Rule((S, P), Event.CONTINUE, S, note="queued requests run"),
    Rule((SU, SE), Event.CONTINUE, None, note="generation runs already"),
    Rule((U, SU), Event.BEGIN, None, refuse=Conflict, why=IN_PROGRESS),
    Rule((J,), Event.BEGIN, None, refuse=Conflict, why=JOINING_WHY),
    Rule((S, SE), Event.BEGIN, None, When.GENERATING, Conflict, "begin_weight_update while generation is in "
         "progress" + PAUSE_FIRST),
    Rule((S, SE), Event.BEGIN, None, refuse=Conflict, why="begin_weight_update needs a paused engine (or "
         "pause_free)" + PAUSE_FIRST),
    Rule((P, E), Event.BEGIN, None, When.BATCH_RUNNING, Conflict, "begin_weight_update while a batch is running"
         + PAUSE_FIRST),
    Rule((P,), Event.BEGIN, U, note="a new session, its id in the answer; it writes the home copy (the addresses "
                                    "sglang's table publishes): in place when served (dirty from here on where "
                                    "senders write it, p2p), else a shadow refreshed from the served copy"),
    Rule((E,), Event.BEGIN, U, note="a new session replaces the unpublished one (recovery); as above"),
    Rule((T,), Event.BEGIN, U, note="a session on a stale engine (dirty: nothing is served before its publication "
                                    "and continue_generation); as above"),
    Rule((U, SU), Event.BEGIN_SHADOW, None, refuse=Conflict, why=IN_PROGRESS),
    Rule((J,), Event.BEGIN_SHADOW, None, refuse=Conflict, why=JOINING_WHY),
    Rule((S, P, E, SE, T), Event.BEGIN_SHADOW, None, When.NO_SHADOW, Conflict,
         "this engine holds no shadow copy (serve --shadow off, or no memory for one): update it paused (pause, "
         "then begin without pause_free)", note="the updater falls back to the paused transaction"),
    Rule((P, E), Event.BEGIN_SHADOW, None, When.BATCH_RUNNING, Conflict, "begin_weight_update while a batch is "
         "running" + PAUSE_FIRST),
    Rule((S,), Event.BEGIN_SHADOW, SU, note="a pause-free session, its id and copy in the answer: the shadow, "
                                             "refreshed from the served copy; generation goes on"),
    Rule((SE,), Event.BEGIN_SHADOW, SU, note="a new pause-free session replaces the unpublished one (recovery)"),
    Rule((P, E), Event.BEGIN_SHADOW, U, note="a session on the shadow of a paused engine (replacing an unpublished "
                                             "one); generation stays paused"),
    Rule((T,), Event.BEGIN_SHADOW, SU, note="a pause-free session on a stale engine: its publication rejoins the "
                                            "fleet; until then nothing is served (dirty)"),
    Rule((U, SU), Event.BEGIN_FAILED, T, When.STALE, note="no session; still stale"),
    Rule((U,), Event.BEGIN_FAILED, P, note="no session; dirty as it was"),
    Rule((SU,), Event.BEGIN_FAILED, S, note="no session; the served copy untouched"),
    Rule((U, SU), Event.WRITE, None, note="the session wrote, into its copy: dirty where that is the served copy; a "
                                          "weight_version given is the version end publishes"),
    Rule((J,), Event.WRITE, None, refuse=Conflict, why=JOINING_WHY),
    Rule((S, P, E, SE, T), Event.WRITE, None, refuse=OutsideSession,
         why="{what} must run between begin_weight_update() and end_weight_update() (the engine is {state}); pause, "
             "begin, write, end", note="a write outside a session (sglang 0.5.23's rule too); nothing is written"),
    Rule((SU, SE), Event.RESET, None, refuse=Conflict, why="reset_tensors during a pause-free weight update; abort "
         "it, or pause first"),
    Rule((J,), Event.RESET, None, refuse=Conflict, why=JOINING_WHY),
    Rule((T,), Event.RESET, None, note="dirty; still stale"),
    Rule((J,), Event.LOAD, None, refuse=Conflict, why=JOINING_WHY),
    Rule((T,), Event.LOAD, None, refuse=Conflict, why=STALE_WHY,
         note="a checkpoint is not the fleet's version"),
    Rule((U, SU), Event.LOAD, None, note="as any write of the session, into its copy (the call's weight_version is "
                                          "the one end publishes)"),
    Rule((S, SE), Event.LOAD, None, When.GENERATING, Conflict, "update_weights_from_disk while generation is in "
         "progress" + PAUSE_FIRST, note="sglang waits for the running requests instead; this engine does not change "
                                        "weights under them"),
    Rule((S, P), Event.LOAD, None, note="no session needed (sglang 0.5.23's rule): every tensor loaded into the "
                                        "served copy and post-load run between batches; clean at the checkpoint, the "
                                        "call's weight_version published; a failed load leaves the weights dirty"),
    Rule((E,), Event.LOAD, P, note="the unpublished session is dropped (a roll-back), then as above"),
    Rule((SE,), Event.LOAD, S, note="the unpublished pause-free session is dropped, then as above"),
    Rule((S, P, U, E, SU, SE), Event.RELEASE, None, When.GENERATING, NotIdle,
         "release_memory_occupation should be called only when server is idle.", note="sglang asserts the same"),
    Rule((S, P, U, E, SU, SE, J, T), Event.RELEASE, None, note="nothing is freed: the parameters keep their memory, "
                                                         "registered with the senders, and their values; no KV cache "
                                                         "or CUDA graph outlives a batch; the tags are recorded"),
    Rule((S, P, U, E, SU, SE, J, T), Event.RESUME, None, note="the tags are cleared; nothing to restore"),
    Rule((E,), Event.RESET, None, refuse=Conflict,
         why="the weight update ended and awaits its holder's verification and publication: a reset now would have it "
             "publish weights it did not write; call /abort_weight_update first",
         note="the holder would publish random weights as its verified version"),
    Rule((S, P, U), Event.RESET, None, When.GENERATING, Conflict, "reset_tensors while generation is in progress"
         + PAUSE_FIRST),
    Rule((S,), Event.RESET, P, note="dirty; queued requests answered 503"),
    Rule((U,), Event.RESET, None, note="dirty; the session wrote (its holder's verification sees it)"),
    Rule((P,), Event.RESET, None, note="dirty; queued requests answered 503"),
    Rule((J,), Event.END, None, refuse=Conflict, why=JOINING_WHY),
    Rule((S, P, E, SE, T), Event.END, None, refuse=Conflict, why="no weight update in progress; call "
         "/begin_weight_update first"),
    Rule((U, SU), Event.END, T, When.STALE_UNWRITTEN, note="nothing to publish: the session closes; still stale"),
    Rule((U,), Event.END, P, When.NOTHING_WRITTEN, note="post-load; nothing to publish: the session closes, dirty "
                                                        "stays dirty"),
    Rule((SU,), Event.END, S, When.NOTHING_WRITTEN, note="nothing to publish: the session closes"),
    Rule((U,), Event.END, P, When.VERSION_GIVEN, note="post-load on the session's copy; the session's version is "
                                                      "published (a flip where the copy is not the served one): clean"),
    Rule((SU,), Event.END, S, When.VERSION_GIVEN, note="post-load on the shadow; the session's version is published "
                                                       "by a flip at the next step boundary"),
    Rule((U,), Event.END, E, note="post-load on the session's copy; awaiting publication (dirty where it is the "
                                  "served one)"),
    Rule((SU,), Event.END, SE, note="post-load on the shadow; awaiting verification and publication"),
    Rule((U, SU), Event.VERSION, None, note="the version end publishes (effect pending)"),
    Rule((E,), Event.VERSION, P, note="the publication (a flip where the session's copy is not the served one): "
                                      "clean at the version (effect published)"),
    Rule((SE,), Event.VERSION, S, note="the publication: a flip at the next step boundary on every rank, answered "
                                       "once flipped (effect published)"),
    Rule((J,), Event.VERSION, None, refuse=Conflict, why=JOINING_WHY),
    Rule((T,), Event.VERSION, None, refuse=Conflict, why=STALE_WHY,
         note="a label cannot make a stale engine current: only a join or a session's publication does"),
    Rule((S, P), Event.VERSION, None, When.DIRTY, Conflict, DIRTY_WHY,
         note="a label cannot clean dirty weights: only a session's publication does"),
    Rule((S, P), Event.VERSION, None, note="a new label of the clean weights (effect labelled)"),
    Rule((J,), Event.ABORT, None, refuse=Conflict, why=JOINING_WHY,
         note="a join is no update session: it ends by itself (serving, or stale when every peer failed)"),
    Rule((S, P, T), Event.ABORT, None, refuse=Conflict, why="no weight update session to abort"),
    Rule((U, E, SU, SE), Event.ABORT, T, When.STALE, note="the session closes unpublished; still stale"),
    Rule((S,), Event.FOREIGN_WRITE, P, note="dirty: the engine pauses, queued requests are answered 503, nothing is "
                                           "served until a session publishes"),
    Rule((P,), Event.FOREIGN_WRITE, None, note="dirty; queued requests answered 503"),
    Rule((U, E), Event.FOREIGN_WRITE, None, note="not looked for: a session's writes change the live weights"),
    Rule((SU, SE), Event.FOREIGN_WRITE, None, note="not looked for while a session is open; the check after its "
                                                 "publication compares against the new reference"),
    Rule((J, T), Event.FOREIGN_WRITE, None, note="not looked for: what is served is not the fleet's version (a join "
                                               "or the next update replaces it)"),
    Rule((U, E), Event.ABORT, P, note="the session closes unpublished: old version, dirty if anything reached the "
                                      "served weights (then queued requests are answered 503)"),
    Rule((SU, SE), Event.ABORT, S, note="the session closes unpublished; the served copy was never touched"),
    Rule((J, T), Event.MARK_STALE, None, note="the fleet's newer version is recorded in the reason"),
    Rule((S, P, U, E, SU, SE), Event.MARK_STALE, T, note="dirty; an open session is aborted, the running batch and "
                                                          "the queued requests end (503)"),
    Rule((J,), Event.JOIN, None, refuse=Conflict, why="a join from a peer is already in progress ({reason})"),
    Rule((U, E, SU, SE), Event.JOIN, None, refuse=Conflict, why=IN_PROGRESS),
    Rule((S, P, T), Event.JOIN, J, note="the running batch and the queued requests end (503); the copy from the "
                                        "first healthy peer goes to the shadow"),
    Rule((J,), Event.JOINED, S, note="the copy is post-loaded and flipped in at the peer's version: clean, serving"),
    Rule((J,), Event.JOIN_FAILED, T, note="every peer failed (each named in the reason); the served copy untouched"),
    Rule((J, T), Event.DONATE, None, refuse=Conflict, why="this engine does not hold the fleet's version ({reason})"),
    Rule((S, P, U, E, SU, SE), Event.DONATE, None, When.DIRTY, Conflict, DIRTY_WHY,
         note="dirty weights are never given away"),
    Rule((U, E), Event.DONATE, None, refuse=Conflict, why="a paused update session may write the served copy in "
         "place; ask another peer, or again after its publication"),
    Rule((S, P, SU, SE), Event.DONATE, None, note="the served copy is written to the joiner while the engine "
                                                  "generates; flips and in-place writes wait until it ends"),
)
"""The engine's state machine (module docstring): for an event, the first rule whose states hold
the engine's state and whose condition holds is the one that applies."""
NOT_LIVE_CHECKED: frozenset[State] = frozenset(
    s for r in TRANSITIONS if r.event is Event.FOREIGN_WRITE and r.note.startswith("not looked for") for s in r.states)
"""States whose ``live weights changed outside a session`` row says "not looked for": the live
check compares nothing in them (a session or a join writes, or what is served is not the fleet's)."""


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
