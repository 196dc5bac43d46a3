"""Contract: the engine's state machine is written once, as the table
:data:`weightsync.engine.states.TRANSITIONS`, and the code, the table and the docs agree.

* docs/engine.md, "States", holds exactly :func:`~weightsync.engine.states.states_markdown`'s
  rendering of the table (regenerate the block between its markers with
  ``python -c "from weightsync.engine.states import states_markdown; print(states_markdown(), end='')"``);
* every state answers every event under every combination of the conditions (no hole);
* the code follows the table: :class:`~weightsync.engine.session.UpdateSessions`, driven through
  each event from each state (over a fake driver: no model), refuses exactly where a rule refuses
  (with the rule's exception and HTTP status) and otherwise ends in the rule's next state; the
  state is assigned nowhere but ``UpdateSessions._enter`` (and its initial value);
* no other module or doc draws the state machine again (an ASCII ``state --event--> state``).
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import weightsync
from weightsync.engine.engine import TransferInfo
from weightsync.engine.scheduler import Scheduler
from weightsync.engine.session import Session, UpdateSessions
from weightsync.engine.states import TRANSITIONS, Event, Facts, State, decide, states_markdown
from weightsync.models import get_model
from weightsync.sync.broadcast_receiver import BroadcastReceiver

ROOT = Path(weightsync.__file__).parent
BEGUN = (State.UPDATING, State.SHADOW_UPDATING)
"""The states a begin enters (where its failure is met)."""
OPEN = (State.UPDATING, State.ENDED, State.SHADOW_UPDATING, State.SHADOW_ENDED)
"""The states with an open session."""
JOIN_OUTCOMES = (Event.JOINED, Event.JOIN_FAILED)
"""Outcomes of a join: met only in the state a join entered (joining)."""
DOC = ROOT.parent / "docs" / "engine.md"
BEGIN_MARK = "<!-- states: generated from weightsync/engine/states.py (TRANSITIONS) -->"
END_MARK = "<!-- states: end -->"


def test_the_docs_table_is_the_code_table():
    text = DOC.read_text()
    assert BEGIN_MARK in text, f"docs/engine.md lacks the marker {BEGIN_MARK}"
    assert END_MARK in text, f"docs/engine.md lacks the marker {END_MARK}"
    block = text[text.index(BEGIN_MARK) + len(BEGIN_MARK):text.index(END_MARK)].strip("\n") + "\n"
    assert block == states_markdown(), ("docs/engine.md's state table differs from TRANSITIONS; the table as the "
                                        "code has it:\n" + states_markdown())


def _cases() -> Iterator[tuple[State, Event, Facts]]:
    """Every (state, event, facts) the engine can meet: a failed begin only happens in a state a
    begin entered (updating, shadow_updating), a join's outcome in joining; every call can come in
    every state."""
    for state, event in itertools.product(State, Event):
        if event is Event.BEGIN_FAILED and state not in BEGUN:
            continue
        if event in JOIN_OUTCOMES and state is not State.JOINING:
            continue
        for values in itertools.product((False, True), repeat=len(Facts.__slots__)):
            yield state, event, Facts(*values)


def test_every_state_answers_every_event():
    for state, event, facts in _cases():
        decide(state, event, facts)  # LookupError on a hole


def test_every_rule_can_apply():
    """No row is shadowed by an earlier one of the same event (each is the first match somewhere)."""
    used = {id(decide(s, e, f)) for s, e, f in _cases()}
    assert [r for r in TRANSITIONS if id(r) not in used] == []


class _FakeDriver:
    """Rank 0's driver without a model: every op answers at once (``fail``: this op raises)."""

    world = 1

    def __init__(self, fail: str = "") -> None:
        spec = get_model("Qwen3-4B", "tiny")  # aborts cancel the receives of a real BroadcastReceiver (no group)
        self.engine = SimpleNamespace(spec=spec, broadcast=BroadcastReceiver(lambda: None, spec, 0), p2p=None)
        self.fail = fail

    def run(self, op: str, **args: Any) -> list[Any]:
        if op == self.fail:
            raise RuntimeError(f"{op} failed on a rank (injected)")
        if op == "begin_update":  # a session opened the sglang way writes copy 0 in place
            shadow = args.get("pause_free", False)
            return [{"target_copy": int(shadow), "flip": "swap" if shadow else None, "in_place": not shadow,
                     "refreshed_bytes": 0, "seconds": 0.0}]
        if op == "publish":
            return [{"flip": None, "seconds": 0.0, "served": 0}]
        return [0.0]

    def shutdown(self) -> None:
        pass


@pytest.fixture
def make() -> Iterator[Callable[..., UpdateSessions]]:
    started: list[Scheduler] = []

    def build(state: State, *, dirty: bool, wrote: bool, version: bool, p2p: bool, shadow: bool,
              fail: str = "", stale: bool = False) -> UpdateSessions:
        sched = Scheduler(_FakeDriver(fail), job_timeout_s=30, stop_timeout_s=30)
        infos = [TransferInfo(session_id="127.0.0.1:1" if p2p else "none://0", weights={}, descriptor=None, copies=[{}],
                              shadow={"pause_free": shadow})]
        sessions = UpdateSessions(sched, transfer_infos=infos, weight_version="v0", group_timeout_s=5)
        sched.start()
        started.append(sched)
        sessions.state, sessions.dirty, sessions.stale = state, dirty, stale  # the test's set-up: any (state, facts)
        if state in OPEN:
            pause_free = state in (State.SHADOW_UPDATING, State.SHADOW_ENDED)
            sessions.session = Session(id="s0", wrote=wrote, version="v1" if version else None, pause_free=pause_free,
                                       copy=int(pause_free), flip="swap" if pause_free else None)
        return sessions

    yield build
    for sched in started:
        sched.stop()


CALLS: dict[Event, Callable[[UpdateSessions], Any]] = {
    Event.GENERATE: lambda s: s.admit(),
    Event.PAUSE: lambda s: s.pause("retract"),
    Event.CONTINUE: lambda s: s.resume(),
    Event.BEGIN: lambda s: s.begin(),
    Event.BEGIN_SHADOW: lambda s: s.begin(pause_free=True),
    Event.WRITE: lambda s: s.update_from_tensor([""], None),
    Event.RESET: lambda s: s.check_weights("reset_tensors"),
    Event.END: lambda s: s.end(),
    Event.VERSION: lambda s: s.set_weight_version("v2"),
    Event.ABORT: lambda s: s.abort(),
    Event.FOREIGN_WRITE: lambda s: s.foreign_write("a test's"),
    Event.MARK_STALE: lambda s: s.mark_stale("v9"),
    Event.JOIN: lambda s: s.start_join("joining: asking a peer"),
    Event.JOINED: lambda s: s.finish_join("v9"),
    Event.JOIN_FAILED: lambda s: s.fail_join("every peer failed (injected)"),
    Event.DONATE: lambda s: s.begin_donation(),
    Event.LOAD: lambda s: s.update_from_disk(CHECKPOINT[0]),
    Event.RELEASE: lambda s: s.release_memory(["weights"]),
    Event.RESUME: lambda s: s.resume_memory(None),
}
LOCKED = (Event.GENERATE, Event.FOREIGN_WRITE)
"""Events whose call expects the caller to hold the lock."""
CHECKPOINT: list[str] = []
"""A tiny checkpoint of the fake driver's model (the disk load validates it before the rows apply)."""


@pytest.fixture(scope="module", autouse=True)
def _checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from tests.engine_helpers import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    write_tiny_checkpoint("Qwen3-4B", path)
    CHECKPOINT.append(str(path))
    yield
    CHECKPOINT.clear()


FAILED_BEGINS = {State.PAUSED: (State.UPDATING, lambda s: s.begin()),
                 State.SERVING: (State.SHADOW_UPDATING, lambda s: s.begin(pause_free=True)),
                 State.STALE: (State.SHADOW_UPDATING, lambda s: s.begin(pause_free=True))}
"""A begin that fails on a rank: from the state it starts in, the state it entered and the call."""


@pytest.mark.parametrize("event", list(Event), ids=str)
def test_the_code_follows_the_table(make: Callable[..., UpdateSessions], event: Event):
    for state, dirty, wrote, version, p2p, shadow, stale in itertools.product(State, *[(False, True)] * 6):
        if event is Event.BEGIN_FAILED and state not in FAILED_BEGINS:
            continue  # the outcome of a begin, reached from a state whose begin gets that far
        if event in JOIN_OUTCOMES and state is not State.JOINING:
            continue
        facts = Facts(dirty=dirty, generating=False, running=False, wrote=wrote and state in OPEN, writable=p2p,
                      version_given=version and state in OPEN, shadow=shadow, stale=stale)
        sessions = make(state, dirty=dirty, wrote=wrote, version=version, p2p=p2p, shadow=shadow, stale=stale,
                        fail="begin_update" if event is Event.BEGIN_FAILED else "")
        where = f"{event} from {state} ({facts})"
        if event is Event.BEGIN_FAILED:
            begun, call = FAILED_BEGINS[state]
            if decide(state, Event.BEGIN_SHADOW if begun is State.SHADOW_UPDATING else Event.BEGIN, facts).refuse:
                continue  # refused before any rank is asked
            rule = decide(begun, event, facts)
            with pytest.raises(RuntimeError, match="injected"):
                call(sessions)
        else:
            rule = decide(state, event, facts)
            if rule.refuse is not None:
                with pytest.raises(rule.refuse) as err, sessions.lock if event in LOCKED else nullcontext():
                    CALLS[event](sessions)
                assert err.value.http_status == rule.refuse.http_status, where  # type: ignore[attr-defined]
                assert sessions.state is state, where
                continue
            with sessions.lock if event in LOCKED else nullcontext():
                CALLS[event](sessions)
        assert sessions.state is (rule.then or state), where


def test_the_state_changes_only_through_a_rule():
    assigned = []
    for path in sorted((ROOT / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for sub in ast.walk(node):
                    targets = sub.targets if isinstance(sub, ast.Assign) else []
                    for t in targets:
                        for e in ast.walk(t):
                            if isinstance(e, ast.Attribute) and e.attr == "state" and isinstance(e.value, ast.Name) \
                                    and e.value.id == "self":
                                assigned.append(f"{path.name}:{node.name}")
    assert sorted(assigned) == ["session.py:__init__", "session.py:_enter"], assigned


ARROW = re.compile(r"\b(serving|paused|updating|ended|shadow_updating|shadow_ended)\b[^\n]{0,20}--\S+-->",
                   re.IGNORECASE)


def test_the_state_machine_is_drawn_nowhere_else():
    places = [*ROOT.rglob("*.py"), *(ROOT.parent / "docs").glob("*.md"), ROOT.parent / "README.md"]
    drawn = [f"{p.relative_to(ROOT.parent)}: {m.group(0)!r}" for p in places for m in ARROW.finditer(p.read_text())]
    assert drawn == [], "the state machine is the table in weightsync/engine/states.py:\n" + "\n".join(drawn)
