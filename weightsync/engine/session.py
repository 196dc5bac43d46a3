"""The engine's weight-update sessions: begin / write / end / publish / abort, pause / continue, reset.

:class:`UpdateSessions` holds the engine's weight state -- its :class:`~weightsync.engine.states.State`,
*dirty* (the served weights may not be the published version; dirty weights are never served), the
published ``weight_version``, the open :class:`Session` (its id, whether it wrote, the version it
publishes) -- with the parameter tables senders write to (``transfer_infos``); the
weight-update groups and the memory occupation are its mixin's,
:mod:`weightsync.engine.session_resources`, the fleet's rows :mod:`weightsync.engine.session_fleet`'s.
Every transition and every refusal is decided by the state machine's table,
:data:`weightsync.engine.states.TRANSITIONS` (docs/engine.md, "States", renders it): a method
looks its event up (:meth:`UpdateSessions._decide`), does its work, and enters the rule's next
state (:meth:`UpdateSessions._enter`, the one place the state changes).

Generation is the :class:`~weightsync.engine.scheduler.Scheduler`'s: this object is its gate (what
may queue, when a batch may start) and stops it for a pause; every driver call of a session runs
as a scheduler job, between batches.

A session writes one copy of the weights (:mod:`weightsync.sync.weight_copies`): opened the
sglang way (on a paused engine), the home copy whose addresses sglang's table publishes; opened
pause-free (``begin_weight_update`` with ``pause_free``), the shadow, while the engine keeps
generating from the served copy. The weights are dirty only while a session may write the served
copy (in place). A session on another copy is published by a flip (:meth:`Scheduler.flip
<weightsync.engine.scheduler.Scheduler.flip>`: at a step boundary of the running batch, or between
batches) and aborted without touching what is served.

Typical usage (rank 0 of ``weightsync serve``)::

    sched = Scheduler(driver)
    sessions = UpdateSessions(sched, transfer_infos=driver.run(Op.TRANSFER_INFO), weight_version="0")
    sched.start()
    sessions.pause(); sessions.begin(); ...writes...; sessions.end(); sessions.set_weight_version("1")
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightsync.engine.control import Op
from weightsync.engine.engine import TransferInfo
from weightsync.engine.loader import validate_checkpoint
from weightsync.engine.scheduler import Scheduler, Unavailable
from weightsync.engine.session_fleet import FleetSessions
from weightsync.engine.session_resources import DEFAULT_GROUP_TIMEOUT_S, ResourceSessions
from weightsync.engine.states import NOT_LIVE_CHECKED, Conflict, Event, Facts, Rule, State, When, decide
from weightsync.models.checkpoint import HFCheckpoint
from weightsync.sync.broadcast_receiver import check_update_request
from weightsync.sync.update_options import FLIPS

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(slots=True)
class Session:
    """One update session (``begin_weight_update`` ... publication or abort)."""

    id: str
    wrote: bool = False
    """An update call or ``reset_tensors`` wrote during it."""
    version: str | None = None
    """The version ``end_weight_update`` publishes (given inside the session)."""
    pause_free: bool = False
    """Opened pause-free: it writes the shadow while the engine generates."""
    copy: int = 0
    """The copy it writes (an index into the published tables)."""
    flip: str | None = None
    """How its publication flips (``swap``, ``copy``), None when it writes the served copy in place."""


class UpdateSessions(FleetSessions, ResourceSessions):
    """The engine's weight state and its update sessions (module docstring); the scheduler's gate.

    Every method that changes the state holds the scheduler's lock while it decides and enters a
    rule; driver work (begin, end, writes, the checker, groups) runs as a scheduler job.
    """

    def __init__(self, scheduler: Scheduler, *, transfer_infos: list[TransferInfo], weight_version: str = "default",
                 group_timeout_s: float | None = None, in_flight_at_flip: str = "keep",
                 joining: str | None = None) -> None:
        """Args:
        scheduler: rank 0's scheduler (this object becomes its gate).
        transfer_infos: every rank's :class:`~weightsync.engine.engine.TransferInfo`: what senders
            write to, and the copies each rank holds.
        weight_version: the version published at start.
        group_timeout_s: how long joining a weight-update group may take (default: the engine's
            receivers' own timeout).
        in_flight_at_flip: what a flip does to the running batch (``keep``, ``recompute``,
            ``abort``; :meth:`Scheduler.flip <weightsync.engine.scheduler.Scheduler.flip>`).
        joining: start ``joining`` with this reason (``serve --join-from``); None: ``serving``.
        """
        self.scheduler = scheduler
        self.driver = scheduler.driver
        self.spec = scheduler.spec
        self.lock = scheduler.lock
        self.transfer_infos = transfer_infos
        self.weight_version = weight_version
        self.group_timeout_s = (group_timeout_s if group_timeout_s is not None
                                else getattr(self.driver.engine.broadcast, "timeout_s", DEFAULT_GROUP_TIMEOUT_S))
        self.p2p = any(not info.session_id.startswith("none://") for info in transfer_infos)
        """Senders can write this engine's memory directly (a p2p transport is registered)."""
        self.shadow = all(info.shadow["pause_free"] for info in transfer_infos)
        """Every rank holds a shadow copy: pause-free sessions are possible."""
        self.in_flight_at_flip = in_flight_at_flip
        self.state = State.SERVING if joining is None else State.JOINING
        self.dirty = False
        self.session: Session | None = None
        self.publications = 0
        """How many times weights were published since start (the live check's reference follows it)."""
        self.join_reason = joining or ""
        """What a joining engine is doing (the 503's and /health's reason)."""
        self.fleet_version: str | None = None
        """The version the fleet published, as ``/mark_stale`` told it (None: not stale)."""
        self.join_error = ""
        """Why the last join failed (every peer's error)."""
        self.stale = False
        """Marked stale (or a join failed) and nothing published since: the served copy is not the fleet's."""
        self._donations = 0
        self._flipping = 0
        self._groups: set[str] = set()
        self._joining: set[str] = set()
        self.released: set[str] = set()
        """Memory tags released (``release_memory_occupation``) and not resumed; nothing is freed."""
        scheduler.attach(self)

    # ------------------------------------------------------------------ the table

    def _facts(self) -> Facts:
        s = self.session
        return Facts(dirty=self.dirty, generating=self.scheduler.generating(), running=self.scheduler.running,
                     wrote=s is not None and s.wrote, writable=self.p2p,
                     version_given=s is not None and s.version is not None, shadow=self.shadow,
                     stale=self.stale)

    def _decide(self, event: Event, what: str = "") -> Rule:
        """The rule for ``event`` now (caller holds the lock).

        Raises:
            The rule's refusal (Conflict, OutsideSession, Unavailable), with its message.
        """
        rule = decide(self.state, event, self._facts())
        if rule.refuse is not None:
            raise rule.refuse(rule.why.format(version=self.weight_version, state=self.state.value, what=what,
                                              reason=self.reason()))
        return rule

    def _enter(self, rule: Rule) -> None:
        """Take ``rule``'s next state (the only place the state changes; caller holds the lock)."""
        if rule.then is not None:
            self.state = rule.then
        self.lock.notify_all()

    def reason(self) -> str:
        """Why a joining or stale engine serves nothing ("" in the other states; lock held)."""
        if self.state is State.JOINING:
            return self.join_reason
        if self.state is State.STALE:
            fleet = f"fleet published {self.fleet_version!r}" if self.fleet_version else "the fleet's version unknown"
            failed = f" (join failed: {self.join_error})" if self.join_error else ""
            return f"stale: holds version {self.weight_version!r}, {fleet}{failed}"
        return ""

    def _check_session(self, session_id: str | None) -> None:
        """A call that names a session must name the current one (caller holds the lock)."""
        if session_id is not None and (self.session is None or self.session.id != session_id):
            # (the current session's id is not said: it is its holder's to send)
            raise Conflict(f"update session {session_id!r} is not this engine's current session: another update "
                           f"began since, or it ended")

    def _fail_queued_if_refused(self) -> None:
        """Queued requests are answered as a new one would be: refused where the ``generate``
        rows refuse (dirty weights and no update in progress: 503; lock held)."""
        try:
            self._decide(Event.GENERATE)
        except Unavailable as exc:
            self.scheduler.fail_queued(exc)

    # ------------------------------------------------------------------ the scheduler's gate

    def may_generate(self) -> bool:
        """A batch may start: serving (a pause-free session may be open), clean weights (the
        ``generate`` rows that run)."""
        return self.state in (State.SERVING, State.SHADOW_UPDATING, State.SHADOW_ENDED) and not self.dirty

    def admit(self) -> None:
        """A new ``/generate`` request may queue (the ``generate`` rows; lock held).

        Raises:
            Unavailable: dirty weights and no update in progress.
        """
        self._decide(Event.GENERATE)

    # ------------------------------------------------------------------ pause, continue

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        """``/pause_generation``: stop serving; returns once no batch runs (the scheduler's module
        docstring says what each mode does to the requests)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        with self.lock:
            self._enter(self._decide(Event.PAUSE))
        self.scheduler.stop_generation("Aborted", retract=mode != "abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self) -> dict[str, Any]:
        """``/continue_generation``."""
        with self.lock:
            self._enter(self._decide(Event.CONTINUE))
        return {"message": "Generation continued successfully.", "status": "ok"}

    # ------------------------------------------------------------------ a session

    def begin(self, pause_free: bool = False, flip: str = "swap", pause: str | None = None) -> dict[str, Any]:
        """``/begin_weight_update``: open a session -- on a paused engine, or ``pause_free`` on a
        serving one that holds a shadow copy; returns its id, the copy it writes
        (``target_copy``, an index into the published tables) and how it is published (``flip``).
        ``pause`` (an extension): :meth:`pause` with this mode first, in the same call.

        Raises:
            Conflict: the engine is serving (pause first, or pause-free), a session is open, or
                pause-free without a shadow copy.
            ValueError: an unknown ``flip`` or pause mode.
        """
        if flip not in FLIPS:
            raise ValueError(f"flip must be one of {', '.join(FLIPS)}, got {flip!r}")
        if pause is not None:
            self.pause(pause)
        event = Event.BEGIN_SHADOW if pause_free else Event.BEGIN
        with self.lock:
            if not pause_free:  # it may write the served copy in place: not while a peer copies it
                self._await_donations("begin_weight_update")
            rule = self._decide(event)
            previous = self.session
            self.session = Session(id=secrets.token_hex(8), pause_free=pause_free)
            self._enter(rule)
            if previous is not None:
                logger.warning("update session %s ended without publishing; session %s takes over",
                               previous.id, self.session.id)
        try:
            per_rank = self.scheduler.call(lambda: self.driver.run(Op.BEGIN_UPDATE, pause_free=pause_free, flip=flip),
                                           "begin_weight_update")
        except BaseException:
            with self.lock:
                if self.state in (State.UPDATING, State.SHADOW_UPDATING):  # (unless an abort closed it meanwhile)
                    self.session = None
                    self._enter(self._decide(Event.BEGIN_FAILED))
            raise
        first = per_rank[0]
        with self.lock:
            session = self.session
            assert session is not None
            session.copy, session.flip = first["target_copy"], first["flip"]
            if self.p2p and first["in_place"]:
                self.dirty = True  # senders may write the served memory from now on
            return {"success": True, "message": "Success", "session_id": session.id, "pause_free": pause_free,
                    "target_copy": session.copy, "flip": session.flip, "state": self.state.value,
                    "refreshed_bytes": sum(r["refreshed_bytes"] for r in per_rank)}

    def end(self, session_id: str | None = None, fingerprint_seed: int | None = None) -> dict[str, Any]:
        """``/end_weight_update``: post-load on the session's copy on every rank, then publish the
        session's version (when it has one and wrote) or wait for the publication.

        ``fingerprint_seed`` (an extension): right after the post-load, in the same driver job and
        before anything is published, the fingerprints of the session's copy on every rank (the
        ``/weights_checker`` ``fingerprint`` action), answered under ``fingerprints`` as that
        action's answer (``{"ranks": [{"rank", "fingerprints", "seed", "nbytes", "seconds"}]}``).

        Raises:
            Conflict: no session is open (or another one is).
        """
        with self.lock:
            self._check_session(session_id)
            self._decide(Event.END)
        hashed: list[dict[str, Any]] = []

        def job() -> list[Any]:
            post_load = self.driver.run(Op.END_UPDATE)
            if fingerprint_seed is not None:  # one job: no other call runs between the two
                hashed.extend(self.driver.run(Op.CHECK_WEIGHTS, action="fingerprint", seed=fingerprint_seed))
            return post_load

        per_rank = self.scheduler.call(job, "end_weight_update")
        hashes = {"fingerprints": {"ranks": [{"rank": r, **v} for r, v in enumerate(hashed)]}} if hashed else {}
        with self.lock:
            self._check_session(session_id)
            rule = self._decide(Event.END)
            session = self.session
            assert session is not None
        published: dict[str, Any] = {}
        if rule.when in (When.NOTHING_WRITTEN, When.STALE_UNWRITTEN):
            # reset_tensors -> begin -> end serves nothing: dirty weights stay dirty
            self.scheduler.call(lambda: self.driver.run(Op.ABORT_UPDATE), "end_weight_update")
            message = "Success. Nothing was written." + (" The weights stay dirty." if self.dirty else "")
        elif rule.when is When.VERSION_GIVEN:
            published = self._flip(session.version)
            message = f"Success. Weight version {session.version} published."
        else:
            message = ("Success. The weights are not published yet: verify them, then call "
                       "/update_weight_version (or /abort_weight_update).")
        with self.lock:
            if rule.when in (When.NOTHING_WRITTEN, When.STALE_UNWRITTEN):
                self.session = None
            elif rule.when is When.VERSION_GIVEN:
                self._published(session.version)  # type: ignore[arg-type]
            self._enter(rule)
            return {"success": True, "message": message, "post_load_seconds": max(per_rank),
                    "per_rank_post_load_seconds": per_rank, "state": self.state.value, "weights_dirty": self.dirty,
                    **published, **hashes}

    def _flip(self, version: str | None) -> dict[str, Any]:
        """Publish the session's copy on every rank (a flip, unless it was written in place) and
        ``version`` with it; waits until it is served. ``{"flip", "flip_at", "flip_seconds",
        "engine_idle_s"}``."""
        assert version is not None

        def on_flip() -> None:  # under the lock, as the flip is applied: batches from here carry it
            self.weight_version = version

        with self.lock:  # a peer copying the served copy finishes first; none starts meanwhile
            self._await_donations("the flip")
            self._flipping += 1
        try:
            out = self.scheduler.flip(version, on_flip=on_flip, in_flight=self.in_flight_at_flip)
        finally:
            with self.lock:
                self._flipping -= 1
                self.lock.notify_all()
        return {"flip": out.get("flip"), "flip_at": out["at"], "flip_seconds": out["seconds"],
                "engine_idle_s": out["idle_s"]}

    def _published(self, version: str) -> None:
        """The session's weights are the served ones at ``version`` (caller holds the lock)."""
        self.weight_version = version
        self.dirty = False
        self.session = None
        self.publications += 1
        self.fleet_version = None
        self.join_error = ""
        self.stale = False

    def abort(self, session_id: str | None = None) -> dict[str, Any]:
        """``/abort_weight_update`` (an extension): end the session without publishing. A session
        opened the sglang way leaves the engine paused at its old version, dirty if it wrote the
        served copy; a pause-free one leaves it serving, untouched.

        Raises:
            Conflict: no session to abort (or another one is current).
        """
        with self.lock:
            self._check_session(session_id)
            rule = self._decide(Event.ABORT)
            aborted = self.session.id if self.session is not None else "none"
            self.session = None
            self._enter(rule)
            self._fail_queued_if_refused()
            self.driver.engine.broadcast.cancel_receives()  # a receive in flight ends (its source may be gone)
        self.scheduler.call(lambda: self.driver.run(Op.ABORT_UPDATE), "abort_weight_update")
        with self.lock:
            return {"success": True, "message": f"Update session {aborted} aborted; weight version "
                                                f"{self.weight_version!r} (dirty: {self.dirty}).",
                    "weights_dirty": self.dirty, "weight_version": self.weight_version, "state": self.state.value}

    def set_weight_version(self, version: str, abort_all_requests: bool = False, session_id: str | None = None,
                           continue_generation: bool = False) -> dict[str, Any]:
        """``/update_weight_version``: the ``update_weight_version`` rows. Returns ``effect``
        (``pending``, ``published`` or ``labelled``) and, for a publication, the flip's
        (:meth:`_flip`). ``continue_generation`` (an extension): after a publication or a label,
        :meth:`resume` in the same call (``continued`` in the answer says whether it did).

        Raises:
            Conflict: dirty weights outside an update (a label cannot clean them).
        """
        out = self._set_weight_version(version, abort_all_requests, session_id)
        if continue_generation and out["effect"] != "pending":
            self.resume()
            out.update(continued=True, state=self.state.value)
        return out

    def _set_weight_version(self, version: str, abort_all_requests: bool, session_id: str | None) -> dict[str, Any]:
        with self.lock:  # refused calls abort nothing
            self._check_session(session_id)
            self._decide(Event.VERSION)
        if abort_all_requests:
            self.scheduler.stop_generation("Aborted", retract=False)
        with self.lock:
            self._check_session(session_id)
            rule = self._decide(Event.VERSION)
            session = self.session
            if self.state in (State.UPDATING, State.SHADOW_UPDATING):
                assert session is not None
                session.version = version
                self._enter(rule)
                return {"effect": "pending", "state": self.state.value}
            if session is None:
                self.weight_version = version
                self._enter(rule)
                return {"effect": "labelled", "state": self.state.value}
            session.version = version
        published = self._flip(session.version)
        with self.lock:
            self._published(version)
            self._enter(rule)
            return {"effect": "published", "state": self.state.value, **published}

    # ------------------------------------------------------------------ writes

    def _require_session(self, what: str, session_id: str | None) -> Session:
        """The open session a write belongs to (caller holds the lock).

        Raises:
            OutsideSession: no session is open (the ``update_weights_from_*`` rows).
        """
        self._check_session(session_id)
        self._decide(Event.WRITE, what)
        assert self.session is not None
        return self.session

    def _run_update(self, what: str, job: Callable[[], list[Any]], weight_version: str | None, message: str,
                    session_id: str | None) -> dict[str, Any]:
        """Run an update call inside the open session (the weights are dirty where it writes the
        served copy)."""
        with self.lock:
            session = self._require_session(what, session_id)
            session.wrote = True
            if session.flip is None:
                self.dirty = True
        per_rank = self.scheduler.call(job, what)
        out: dict[str, Any] = {"success": True, "per_rank": per_rank}
        if weight_version is not None:
            with self.lock:
                session.version = weight_version
            message += f" Weight version updated to {weight_version}."
        out["message"] = message
        return out

    def update_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        session_id: str | None = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_distributed``: receive full tensors from the trainer's group."""
        with self.lock:
            self._require_session("update_weights_from_distributed", session_id)
            epoch = self.driver.engine.broadcast.cancel.value  # an abort or destroy from here on ends it
        check_update_request(self.spec, names, dtypes, shapes)
        if group_name not in self._groups:
            raise ValueError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        return self._run_update(
            "update_weights_from_distributed",
            lambda: self.driver.run(
                Op.UPDATE_FROM_DISTRIBUTED, names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                epoch=epoch,
            ),
            weight_version,
            "Succeeded to update parameter online.",
            session_id,
        )

    def update_from_tensor(
        self, entries: list[str], load_format: str | None, weight_version: str | None = None,
        session_id: str | None = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_tensor``: every rank decodes and writes its own entry."""
        with self.lock:
            self._require_session("update_weights_from_tensor", session_id)
        ranks = self.driver.world
        if len(entries) != ranks:
            raise ValueError(
                f"serialized_named_tensors has {len(entries)} entries; this engine has {ranks} TP ranks (one each)"
            )
        return self._run_update(
            "update_weights_from_tensor",
            lambda: self.driver.run(Op.UPDATE_FROM_TENSOR, entries=entries, load_format=load_format),
            weight_version,
            "Success",
            session_id,
        )

    def update_from_disk(self, path: str, weight_version: str | None = None,
                         session_id: str | None = None) -> dict[str, Any]:
        """``/update_weights_from_disk``: reload every tensor from an HF checkpoint (validated
        first) -- inside a session as one of its writes, outside one (sglang 0.5.23 needs none) as
        a whole update of its own: loaded, post-load run, clean at the checkpoint (the ``update_
        weights_from_disk`` rows).

        Raises:
            Conflict: serving with generation in progress (pause first).
            ValueError: a checkpoint that cannot be read (the path named) or does not fit the model.
        """
        what = "update_weights_from_disk"
        with self.lock:
            self._check_session(session_id)
            self._decide(Event.LOAD, what)
        try:
            with HFCheckpoint(path) as ckpt:
                validate_checkpoint(self.spec, ckpt)
        except OSError as exc:  # a path the filesystem refuses (too long, unreadable): the caller's input
            raise ValueError(f"cannot read the checkpoint {path[:200]!r}: {exc.strerror or exc}") from None
        message = "Succeeded to update model weights."
        with self.lock:
            rule = self._decide(Event.LOAD, what)
            in_session = self.state in (State.UPDATING, State.SHADOW_UPDATING)
            dropped = not in_session and self.session is not None
            if not in_session:
                self.session = None  # an ended, unpublished session is dropped (the rows of the other states)
                self._enter(rule)
                # the served weights change: a live check under way or taken mid-load compares nothing
                self.publications += 1
        if in_session:
            return self._run_update(what, lambda: self.driver.run(Op.UPDATE_FROM_DISK, path=path), weight_version,
                                    message, session_id)
        try:
            if dropped:  # its copy closes unpublished; the load goes into the served one
                self.scheduler.call(lambda: self.driver.run(Op.ABORT_UPDATE), what)
            per_rank = self.scheduler.call(lambda: self.driver.run(Op.LOAD_CHECKPOINT, path=path), what)
            self.scheduler.call(lambda: self.driver.run(Op.POST_LOAD), what)
        except BaseException:
            with self.lock:
                self.dirty = True  # partly loaded
                self._fail_queued_if_refused()
            raise
        with self.lock:
            self.dirty = False
            self.publications += 1  # the live check's next reference is the loaded checkpoint
            if weight_version is not None:
                self.weight_version = weight_version
                message += f" Weight version updated to {weight_version}."
            self.lock.notify_all()
        return {"success": True, "message": message, "per_rank": per_rank, "num_paused_requests": 0}

    def check_weights(
        self, action: str, seed: int = 0, allow_quant_error: bool = False, skip: tuple[str, ...] = ()
    ) -> list[Any]:
        """``/weights_checker``: per-rank results of ``action`` (``reset_tensors``: the
        ``weights_checker reset_tensors`` rows -- dirty, and a serving engine pauses)."""
        if action == "reset_tensors":
            with self.lock:
                self._await_donations("reset_tensors")
                rule = self._decide(Event.RESET)
                self.dirty = True
                if self.state in (State.UPDATING, State.SHADOW_UPDATING):
                    assert self.session is not None
                    self.session.wrote = True
                self._enter(rule)
                self._fail_queued_if_refused()
        return self.scheduler.call(
            lambda: self.driver.run(
                Op.CHECK_WEIGHTS, action=action, seed=seed, allow_quant_error=allow_quant_error, skip=skip
            ),
            f"weights_checker {action}",
        )

    def foreign_write(self, what: str) -> bool:
        """The live check found the served weights changed outside a session (the ``live weights
        changed outside a session`` rows): dirty, a serving engine pauses. False where the table says
        "not looked for" (a session or a join writes; nothing changes). Caller holds the lock."""
        if self.state in NOT_LIVE_CHECKED:
            return False
        logger.error("the served weights of version %r changed outside an update session (%s): nothing is served "
                     "until an update session publishes", self.weight_version, what)
        rule = self._decide(Event.FOREIGN_WRITE)
        self.dirty = True
        self._enter(rule)
        self._fail_queued_if_refused()
        return True

    # ------------------------------------------------------------------ state

    def status(self) -> dict[str, Any]:
        """``/server_info``'s ``internal_states``: the state, dirty, the published and pending
        versions, the session, and the scheduler's queue and fault."""
        with self.lock:
            return {
                "state": self.state.value,
                "weights_dirty": self.dirty,
                "weight_version": self.weight_version,
                "session_id": self.session.id if self.session is not None else None,
                "pending_weight_version": self.session.version if self.session is not None else None,
                "session_pause_free": self.session.pause_free if self.session is not None else None,
                "shadow": self.shadow,
                "reason": self.reason() or None,
                "fleet_weight_version": self.fleet_version,
                "memory_released": sorted(self.released),
                **self.scheduler.status(),
            }

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """``/health``: alive unless faulted or stopping (a paused or dirty engine is alive: it
        answers and can be updated); with the state, dirty flag and published version."""
        st = self.status()
        ok = st["fault"] is None and not self.scheduler.stopped
        reason = st["fault"] or st["reason"]
        return ok, {"status": "ok" if ok else "unhealthy", **({"reason": reason} if reason else {}),
                    **{k: st[k] for k in ("state", "weights_dirty", "weight_version")}}
