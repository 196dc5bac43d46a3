"""Rank 0's scheduler: one driver thread that batches generation, serializes weight work, and owns
the engine's state machine.

States (``/server_info`` ``internal_states`` and ``/health`` report them, with ``weights_dirty``
and the published ``weight_version``)::

    SERVING  --pause_generation-->   PAUSED   --continue_generation-->  SERVING   (refused while dirty)
    PAUSED   --begin_weight_update--> UPDATING                                     (a new session)
    UPDATING --end_weight_update-->  PAUSED, clean at the session's version        (a version was given and
                                                                                     something was written)
                                 |-> ENDED, dirty: awaiting publication            (no version yet)
                                 |-> PAUSED, clean, old version                     (nothing could be written)
    ENDED    --update_weight_version(v)--> PAUSED, clean at v                       (the publication)
    UPDATING | ENDED --abort_weight_update--> PAUSED, dirty at the old version      (clean if nothing reached
                                                                                     the served weights)
    ENDED | PAUSED (dirty) --begin_weight_update--> UPDATING                         (recovery by a new session)

**Writes.** Every weight write -- ``update_weights_from_distributed`` / ``_tensor`` / ``_disk`` --
is accepted only inside a session (UPDATING), which ``begin_weight_update`` opens only on a
PAUSED engine (sglang 0.5.23 refuses update calls outside begin ... end too); a write outside is a
400 naming the rule. A p2p engine's memory is writable by its senders at any time (one-sided
transports): its session makes the weights *dirty* from ``begin_weight_update`` on; with a
staged transport (shm) the served weights change only when ``end_weight_update`` copies the inbox
in (:mod:`weightsync.sync.p2p_receiver`), so writes outside a session have no effect. ``reset_tensors``
(the checker) is also accepted outside a session, as miles sends it (``placement_group.py``), on an
engine that is not generating: it makes the weights dirty and pauses the engine.

**Dirty** means the served weights may not be the published version. Dirty weights are never
served: outside an update in progress (PAUSED dirty) ``/generate`` is refused with 503 and the
queued requests are answered so; during one (UPDATING, ENDED) requests queue and run after the
publication and ``continue_generation``. Only a session clears dirty, and only by publishing:
a version given inside it (``update_weight_version`` before ``end_weight_update``, or an update
call's ``weight_version``: miles' order) is published by ``end_weight_update`` when something
was written (or could be: a p2p engine); otherwise ``end_weight_update`` leaves it ENDED and the
session's holder publishes with ``update_weight_version`` once it has verified the update (the
checksums of ``/weights_checker``). ``abort_weight_update`` (an extension) ends a session without
publishing. A session id is returned by ``begin_weight_update``; a call that carries one
(header ``X-Weightsync-Session``) must match the session it acts on.

Generation requests that arrive while PAUSED (clean) or during an update are queued, not
refused: they start when the engine is SERVING again. ``pause_generation`` waits for the running
batch to stop. Mode ``abort`` (sglang's default) ends the running batch at its next step and
returns the queued requests, all with finish reason ``abort`` and the tokens they had; ``retract``
(and ``in_place``, which is the same here) stops the running batch the same way but requeues its
unfinished requests *with the tokens they generated*: after ``continue_generation`` each
re-prefills prompt + generated tokens (no KV is kept across a pause: the weights may change
meanwhile) and goes on until its own ``max_new_tokens``; its one answer holds every token, the
logprobs recorded when each was generated, and ``num_retractions``. ``abort_request`` ends one
request (queued: at once; running: the batch stops and its other requests are requeued as by
``retract``) or all of them. A weight call while a batch runs, or while queued requests are
about to run (SERVING), is refused with :class:`Conflict` (HTTP 409): pause first.

**Limits and deadlines.** At most ``max_queued_requests`` requests wait or run (429 beyond:
:class:`QueueFull`); every job handed to the driver thread is waited for at most
``job_timeout_s``, stopping the running batch at most ``stop_timeout_s``, joining a weight-update
group at most ``group_timeout_s`` (the engine generates meanwhile: the join runs in the
background on every rank and is polled); each timeout raises :class:`EngineTimeout` naming what
and how long. A batch whose step failed on rank 0 ends on every rank (the requests get the error,
the engine goes on); any other failure of a batch marks the engine faulted (``/health`` 503).

Every collective runs on the driver thread; HTTP handlers (in their own threads) submit work and
wait for its future.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from weightsync.engine.control import Driver, Op, RankError
from weightsync.engine.engine import GenRequest, GenResult
from weightsync.engine.loader import validate_checkpoint
from weightsync.engine.sampling import SamplingParams
from weightsync.models.checkpoint import HFCheckpoint
from weightsync.sync.broadcast_receiver import check_update_request

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
DEFAULT_MAX_QUEUED = 1024
DEFAULT_JOB_TIMEOUT_S = 1800.0
DEFAULT_STOP_TIMEOUT_S = 360.0
DEFAULT_GROUP_TIMEOUT_S = 600.0
GROUP_POLL_S = 0.05


class State(enum.StrEnum):
    SERVING = "serving"
    PAUSED = "paused"
    UPDATING = "updating"
    ENDED = "ended"
    """A session ended (post-load done) and waits for its holder to publish a version."""


class Conflict(Exception):
    """The call conflicts with the engine's state (HTTP 409); the message says what to do."""


class Unavailable(Exception):
    """The engine cannot serve the request now (HTTP 503): dirty weights, a fault, shutting down."""


class QueueFull(Exception):
    """Too many requests wait or run (HTTP 429)."""


class EngineTimeout(TimeoutError):
    """A bounded wait inside the engine expired; the message names what and how long."""


class OutsideSession(ValueError):
    """A weight write outside ``begin_weight_update ... end_weight_update`` (HTTP 400, as sglang)."""


HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"
"""rid prefix of ``/health_generate`` probes (sglang's)."""


@dataclass(slots=True)
class _Pending:
    req: GenRequest
    """What runs next: the request itself, or its continuation after a retract."""
    future: Future
    partial: GenResult | None = None
    """What the request generated before it was retracted (None: never retracted)."""


@dataclass(slots=True)
class Session:
    """One update session (``begin_weight_update`` ... publication or abort)."""

    id: str
    wrote: bool = False
    """An update call or ``reset_tensors`` wrote during it."""
    version: str | None = None
    """The version ``end_weight_update`` publishes (given inside the session)."""


def _aborted(req: GenRequest, why: str, partial: GenResult | None = None) -> GenResult:
    res = partial if partial is not None else GenResult(rid=req.rid)
    res.finish_reason = {"type": "abort", "message": why}
    return res


def _merge(partial: GenResult | None, new: GenResult) -> GenResult:
    """A retracted request's result so far followed by what its continuation generated."""
    if partial is None:
        return new
    return GenResult(
        rid=partial.rid,
        output_ids=partial.output_ids + new.output_ids,
        output_logprobs=partial.output_logprobs + new.output_logprobs,
        input_logprobs=partial.input_logprobs,
        output_top_logprobs=partial.output_top_logprobs + new.output_top_logprobs,
        output_token_ids_logprobs=partial.output_token_ids_logprobs + new.output_token_ids_logprobs,
        input_top_logprobs=partial.input_top_logprobs,
        input_token_ids_logprobs=partial.input_token_ids_logprobs,
        finish_reason=new.finish_reason,
        num_retractions=partial.num_retractions,
    )


def _continuation(req: GenRequest, done: GenResult) -> GenRequest:
    """The request that goes on from ``done``: prompt + generated tokens, no prompt logprobs again."""
    original = req.input_ids[: len(req.input_ids) - len(req.prior_output_ids)]
    return dataclasses.replace(
        req,
        input_ids=original + tuple(done.output_ids),
        prior_output_ids=tuple(done.output_ids),
        logprob_start_len=-1,
    )


def _resolve(fut: Future, value: Any = None, exc: BaseException | None = None) -> None:
    """Complete ``fut`` unless its waiter gave up (a cancelled future cannot take a result)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except InvalidStateError:
        pass  # cancelled by its waiter (client gone): nobody to answer


class Scheduler:
    """See the module docstring.

    Typical usage::

        sched = Scheduler(driver, transfer_infos=driver.run(Op.TRANSFER_INFO))
        sched.start()
        result, version = sched.submit([req])[0].result()
        sched.stop()
    """

    def __init__(
        self,
        driver: Driver,
        *,
        transfer_infos: list[Any],
        max_batch_size: int = 32,
        weight_version: str = "default",
        max_queued_requests: int = DEFAULT_MAX_QUEUED,
        job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
        group_timeout_s: float | None = None,
    ) -> None:
        """Args:
        driver: rank 0's driver of the engine's ranks.
        transfer_infos: every rank's ``(session id, weights, descriptor)``.
        max_batch_size: requests per batch.
        weight_version: the version published at start.
        max_queued_requests: requests waiting or running at once (more: :class:`QueueFull`).
        job_timeout_s: how long a caller waits for a job on the driver thread.
        stop_timeout_s: how long stopping the running batch (pause, abort, stop) may take.
        group_timeout_s: how long joining a weight-update group may take (default: the engine's
            receivers' own timeout).
        """
        self.driver = driver
        self.spec = driver.engine.spec
        self.transfer_infos = transfer_infos
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.max_queued_requests = max_queued_requests
        self.job_timeout_s = job_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.group_timeout_s = (group_timeout_s if group_timeout_s is not None
                                else getattr(driver.engine.broadcast, "timeout_s", DEFAULT_GROUP_TIMEOUT_S))
        self.p2p = any(not str(info[0]).startswith("none://") for info in transfer_infos)
        """Senders can write this engine's memory directly (a p2p transport is registered)."""
        self.staged = bool(getattr(driver.engine.p2p, "staged", False))
        """p2p writes land in an inbox that only ``end_weight_update`` copies in."""
        self.state = State.SERVING
        self.dirty = False
        self.session: Session | None = None
        self._groups: set[str] = set()
        self._joining: set[str] = set()
        self._cv = threading.Condition()
        self._pending: deque[_Pending] = deque()
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()
        self._running = False
        self._abort = False
        self._retract = False
        self._cancel: set[str] = set()
        """rids that ``abort_request`` ends while their batch runs (the others are requeued)."""
        self._rids: set[str] = set()
        """rids of every request not answered yet (sglang refuses a duplicate)."""
        self._fault: str | None = None
        """Why the engine is unhealthy (a batch failed on some rank, the driver is stuck), or None."""
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-driver", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> bool:
        """Finish the running work (at most ``stop_timeout_s``), fail queued requests, release the
        worker ranks. Returns False when the driver thread did not stop in time (the ranks are
        then left to die with this process)."""
        with self._cv:
            self._stopped = True
            self._abort = True
            self._cv.notify_all()
        self._thread.join(timeout=self.stop_timeout_s)
        if self._thread.is_alive():
            logger.error("the engine's driver did not stop within %.0f s (stuck in a collective?); "
                         "leaving the ranks to exit with this process", self.stop_timeout_s)
            return False
        self.driver.shutdown()
        return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._jobs or (self._can_generate() and self._pending)):
                    self._cv.wait()
                if self._jobs:
                    job, fut = self._jobs.popleft()
                    batch = None
                elif self._stopped:
                    break
                else:
                    batch = [self._pending.popleft() for _ in range(min(self.max_batch_size, len(self._pending)))]
                    for p in batch:
                        if p.future.cancelled():  # its client went away
                            self._rids.discard(p.req.rid)
                    batch = [p for p in batch if not p.future.cancelled()]
                    if not batch:
                        continue
                    self._running = True
                    version = self.weight_version
            if batch is None:
                self._run_job(job, fut)
            else:
                self._run_batch(batch, version)
        with self._cv:
            for p in self._pending:
                self._answer(p, exc=Unavailable("the engine is shutting down"))
            self._pending.clear()

    def _can_generate(self) -> bool:
        return self.state is State.SERVING and not self.dirty and self._fault is None

    @staticmethod
    def _run_job(job: Callable[[], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(job())
        except BaseException as exc:  # handed to the waiting caller, which re-raises it
            fut.set_exception(exc)

    def _run_batch(self, batch: list[_Pending], version: str) -> None:
        try:
            results = self.driver.run(Op.GENERATE, should_abort=lambda: self._abort, reqs=[p.req for p in batch])[0]
        except BaseException as exc:
            step_failed = isinstance(exc, RankError) and exc.step_error
            with self._cv:
                if not step_failed:  # the ranks may be out of step: stop serving
                    self._fault = f"a generation batch failed: {exc}"
                    logger.error("engine fault: %s", self._fault)
                for p in batch:
                    self._answer(p, exc=exc)
                self._running = False
                self._cv.notify_all()
            return
        with self._cv:
            requeue = []
            for p, r in zip(batch, results):
                merged = _merge(p.partial, r)
                aborted = bool(r.finish_reason) and r.finish_reason.get("type") == "abort"
                if aborted and self._retract and p.req.rid not in self._cancel and "status_code" not in r.finish_reason:
                    merged.num_retractions += 1
                    requeue.append(_Pending(_continuation(p.req, merged), p.future, merged))
                else:
                    self._answer(p, (merged, version))
            self._pending.extendleft(reversed(requeue))
            self._running = False
            self._cv.notify_all()

    def _answer(self, p: _Pending, value: Any = None, exc: BaseException | None = None) -> None:
        """Resolve ``p`` and forget its rid (caller holds the lock)."""
        self._rids.discard(p.req.rid)
        _resolve(p.future, value, exc)

    def _call(self, job: Callable[[], Any], what: str = "", timeout_s: float | None = None) -> Any:
        """Run ``job`` on the driver thread (after the running batch) and wait for its result, at
        most ``timeout_s`` (default ``job_timeout_s``).

        Raises:
            Unavailable: shutting down, or the engine is faulted.
            EngineTimeout: no result in time (the engine is marked faulted: its driver is stuck).
        """
        fut: Future = Future()
        limit = self.job_timeout_s if timeout_s is None else timeout_s
        with self._cv:
            if self._stopped:
                raise Unavailable("the engine is shutting down")
            if self._fault is not None:
                raise Unavailable(f"the engine is faulted ({self._fault}); restart it")
            self._jobs.append((job, fut))
            self._cv.notify_all()
        try:
            return fut.result(timeout=limit)
        except TimeoutError:
            if fut.cancel():  # never started: the driver is busy, not stuck
                raise EngineTimeout(f"{what or 'engine job'} did not start within {limit:.0f} s "
                                    f"(the engine is busy)") from None
            with self._cv:
                self._fault = f"{what or 'an engine job'} did not finish within {limit:.0f} s"
            raise EngineTimeout(f"{self._fault}; the engine is marked faulted (restart it)") from None

    # ------------------------------------------------------------------ generation

    def submit(self, reqs: list[GenRequest]) -> list[Future]:
        """Queue requests; each future resolves to ``(GenResult, weight_version)``.

        Raises:
            ValueError: a rid is already in flight (sglang refuses duplicates too).
            Unavailable: the weights are dirty outside an update, the engine is faulted or stopping.
            QueueFull: more than ``max_queued_requests`` would wait or run.
        """
        futures = []
        with self._cv:
            if self._stopped:
                raise Unavailable("the engine is shutting down")
            if self._fault is not None:
                raise Unavailable(f"the engine is faulted ({self._fault}); restart it")
            if self._dirty_idle():
                raise Unavailable(self._dirty_message())
            if len(self._rids) + len(reqs) > self.max_queued_requests:
                raise QueueFull(f"{len(self._rids)} requests are waiting or running; this engine takes at most "
                                f"{self.max_queued_requests} (retry later)")
            dup = sorted({r.rid for r in reqs} & self._rids)
            if dup:
                raise ValueError(f"duplicate request id(s) {dup[:5]}: a request with this rid is still in flight")
            for r in reqs:
                fut: Future = Future()
                self._pending.append(_Pending(r, fut))
                self._rids.add(r.rid)
                futures.append(fut)
            self._cv.notify_all()
        return futures

    def _dirty_idle(self) -> bool:
        """Dirty weights and no update in progress that could clean them (caller holds the lock)."""
        return self.dirty and self.state not in (State.UPDATING, State.ENDED)

    def _dirty_message(self) -> str:
        return (f"the engine's weights are dirty (reset, or partly written by an update that was not published) "
                f"and no update is in progress: nothing is served until an update session writes, verifies and "
                f"publishes them (weight version still {self.weight_version!r})")

    def _fail_queued(self, exc: BaseException) -> None:
        """Answer every queued request with ``exc`` (caller holds the lock)."""
        for p in self._pending:
            self._answer(p, exc=exc)
        self._pending.clear()

    def _stop_batch(self, *, requeue: bool, cancel: set[str] = frozenset()) -> None:
        """Stop the running batch at its next step and wait (at most ``stop_timeout_s``);
        unfinished requests are requeued with their tokens when ``requeue`` (except ``cancel``),
        else answered as aborted. Caller holds the lock.

        Raises:
            EngineTimeout: the batch did not stop in time (the engine is marked faulted).
        """
        if not self._running:
            return
        self._abort, self._retract, self._cancel = True, requeue, set(cancel)
        end = time.monotonic() + self.stop_timeout_s
        try:
            while self._running:
                if not self._cv.wait(timeout=max(end - time.monotonic(), 0.0)) and time.monotonic() >= end:
                    self._fault = f"the running batch did not stop within {self.stop_timeout_s:.0f} s"
                    raise EngineTimeout(f"{self._fault}; the engine is marked faulted (restart it)")
        finally:
            self._abort, self._retract, self._cancel = False, False, set()

    def _abort_all(self, why: str, retract: bool) -> int:
        """Stop the running batch (waits) and, unless retracting, answer queued requests as aborted."""
        with self._cv:
            dropped = 0
            if not retract:
                dropped = len(self._pending)
                for p in self._pending:
                    self._answer(p, (_aborted(p.req, why, p.partial), self.weight_version))
                self._pending.clear()
            self._stop_batch(requeue=retract)
            return dropped

    def abort_request(self, rid: str | None, abort_all: bool = False, message: str | None = None) -> int:
        """``/abort_request``: end request ``rid`` (or every request); returns how many ended.

        A queued request is answered at once; a running one ends at the batch's next step with
        the tokens it has (the batch's other requests are requeued and go on).
        """
        why = message or "Aborted"
        if abort_all:
            with self._cv:
                n = len(self._rids)
            self._abort_all(why, retract=False)
            return n
        with self._cv:
            for p in list(self._pending):
                if p.req.rid == rid:
                    self._pending.remove(p)
                    self._answer(p, (_aborted(p.req, why, p.partial), self.weight_version))
                    return 1
            if rid in self._rids and self._running:
                self._stop_batch(requeue=True, cancel={rid})
                return 1
            return 0

    def health_check(self, timeout_s: float) -> tuple[bool, str]:
        """``/health_generate``: generate one token (sglang's probe) within ``timeout_s``.

        The probe queues like any request (behind a pause too, as in sglang); dirty weights, a
        fault or a full queue fail it at once. Returns ``(healthy, why not)``.
        """
        probe = GenRequest(
            rid=f"{HEALTH_CHECK_PREFIX}{uuid.uuid4().hex}",
            input_ids=(0,),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        try:
            fut = self.submit([probe])[0]
        except (Unavailable, QueueFull) as exc:
            return False, str(exc)
        try:
            fut.result(timeout=timeout_s)
        except TimeoutError:
            with self._cv:
                self._pending = deque(p for p in self._pending if p.future is not fut)
                self._rids.discard(probe.rid)
            fut.cancel()
            return False, f"no token generated within {timeout_s:.0f} s (state {self.state.value})"
        except Exception as exc:  # the probe's own failure is the answer
            return False, f"the probe failed: {exc}"
        return True, ""

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """``/health``: alive unless faulted or stopping (a paused or dirty engine is alive: it
        answers and can be updated); with the state, dirty flag and published version."""
        st = self.status()
        ok = self._fault is None and not self._stopped
        return ok, {"status": "ok" if ok else "unhealthy", **({"reason": self._fault} if self._fault else {}),
                    **{k: st[k] for k in ("state", "weights_dirty", "weight_version")}}

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        """``/pause_generation``: stop serving; returns once no batch runs (see the module docstring)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        with self._cv:
            if self.state is State.SERVING:
                self.state = State.PAUSED
        self._abort_all("Aborted", retract=mode != "abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self) -> dict[str, Any]:
        """``/continue_generation``."""
        with self._cv:
            if self.state is State.UPDATING:
                raise Conflict("a weight update is in progress; call /end_weight_update first")
            if self.state is State.ENDED:
                raise Conflict("the weight update ended but was not published: verify it and call "
                               "/update_weight_version (or /abort_weight_update) first")
            if self.dirty:
                raise Conflict(self._dirty_message())
            self.state = State.SERVING
            self._cv.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # ------------------------------------------------------------------ update sessions

    def _refuse_if_generating(self, what: str) -> None:
        # Queued requests only count while they can run (SERVING with clean weights).
        if self._running or (self._can_generate() and self._pending):
            raise Conflict(f"{what} while generation is in progress; call /pause_generation first")

    def _check_session(self, session_id: str | None) -> None:
        """A call that names a session must name the current one (caller holds the lock)."""
        if session_id is not None and (self.session is None or self.session.id != session_id):
            current = self.session.id if self.session is not None else "none"
            raise Conflict(f"update session {session_id!r} is not this engine's current session ({current}): "
                           f"another update began since")

    def _require_session(self, what: str, session_id: str | None) -> Session:
        """The open session a write belongs to (caller holds the lock)."""
        self._check_session(session_id)
        if self.state is not State.UPDATING or self.session is None:
            raise OutsideSession(f"{what} must run between begin_weight_update() and end_weight_update() "
                                 f"(the engine is {self.state.value}); pause, begin, write, end")
        return self.session

    def begin_update(self) -> dict[str, Any]:
        """``/begin_weight_update``: open a session on a paused engine; returns its id.

        Raises:
            Conflict: the engine is serving (pause first) or a session is open.
        """
        with self._cv:
            if self.state is State.UPDATING:
                raise Conflict("a weight update is already in progress (begin_weight_update was called); "
                               "end or abort it first")
            if self.state is State.SERVING:
                self._refuse_if_generating("begin_weight_update")
                raise Conflict("begin_weight_update needs a paused engine; call /pause_generation first")
            if self._running:
                raise Conflict("begin_weight_update while a batch is running; call /pause_generation first")
            previous = self.session
            self.session = Session(id=secrets.token_hex(8))
            self.state = State.UPDATING
            if previous is not None:
                logger.warning("update session %s ended without publishing; session %s takes over",
                               previous.id, self.session.id)
        try:
            self._call(lambda: self.driver.run(Op.BEGIN_UPDATE), "begin_weight_update")
        except BaseException:
            with self._cv:
                self.state, self.session = State.PAUSED, None
            raise
        with self._cv:
            if self.p2p and not self.staged:
                self.dirty = True  # senders may write the served memory from now on
            return {"success": True, "message": "Success", "session_id": self.session.id}

    def end_update(self, session_id: str | None = None) -> dict[str, Any]:
        """``/end_weight_update``: commit a staged inbox, post-load derivations on every rank, then
        publish the session's version (when it has one and wrote) or wait for the publication.

        Raises:
            Conflict: no session is open (or another one is).
        """
        with self._cv:
            self._check_session(session_id)
            if self.state is not State.UPDATING or self.session is None:
                raise Conflict("no weight update in progress; call /begin_weight_update first")
        per_rank = self._call(lambda: self.driver.run(Op.END_UPDATE), "end_weight_update")
        with self._cv:
            session = self.session
            assert session is not None
            if self.staged:
                self.dirty = True  # the inbox is served now: it may hold anything a sender wrote
            if not (session.wrote or self.p2p):
                # Nothing was written (and nothing could be): there is nothing to publish; dirty
                # weights stay dirty (reset_tensors -> begin -> end serves nothing).
                self.state, self.session = State.PAUSED, None
                message = "Success. Nothing was written." + (" The weights stay dirty." if self.dirty else "")
            elif session.version is not None:
                self._publish(session.version)
                message = f"Success. Weight version {session.version} published."
            else:
                self.dirty = True
                self.state = State.ENDED
                message = ("Success. The weights are not published yet: verify them, then call "
                           "/update_weight_version (or /abort_weight_update).")
            self._cv.notify_all()
            return {"success": True, "message": message, "post_load_seconds": max(per_rank),
                    "per_rank_post_load_seconds": per_rank, "state": self.state.value, "weights_dirty": self.dirty}

    def _publish(self, version: str) -> None:
        """The session's weights become the served ones at ``version`` (caller holds the lock)."""
        self.weight_version = version
        self.dirty = False
        self.state = State.PAUSED
        self.session = None

    def abort_update(self, session_id: str | None = None) -> dict[str, Any]:
        """``/abort_weight_update`` (an extension): end the session without publishing; the engine
        stays paused at its old version, dirty if anything reached the served weights.

        Raises:
            Conflict: no session to abort (or another one is current).
        """
        with self._cv:
            self._check_session(session_id)
            if self.state not in (State.UPDATING, State.ENDED) or self.session is None:
                raise Conflict("no weight update session to abort")
            aborted = self.session.id
            self.state, self.session = State.PAUSED, None
            if self.dirty:
                self._fail_queued(Unavailable(self._dirty_message()))
            self._cv.notify_all()
            return {"success": True, "message": f"Update session {aborted} aborted; weight version "
                                                f"{self.weight_version!r} (dirty: {self.dirty}).",
                    "weights_dirty": self.dirty, "weight_version": self.weight_version}

    def _run_update(self, what: str, job: Callable[[], list[Any]], weight_version: str | None, message: str,
                    session_id: str | None) -> dict[str, Any]:
        """Run an update call inside the open session (it makes the weights dirty unless staged)."""
        with self._cv:
            session = self._require_session(what, session_id)
            session.wrote = True
            if not self.staged:
                self.dirty = True
        per_rank = self._call(job, what)
        out: dict[str, Any] = {"success": True, "per_rank": per_rank}
        if weight_version is not None:
            with self._cv:
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
        with self._cv:
            self._require_session("update_weights_from_distributed", session_id)
        check_update_request(self.spec, names, dtypes, shapes)
        if group_name not in self._groups:
            raise ValueError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        return self._run_update(
            "update_weights_from_distributed",
            lambda: self.driver.run(
                Op.UPDATE_FROM_DISTRIBUTED, names=names, dtypes=dtypes, shapes=shapes, group_name=group_name
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
        with self._cv:
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
        """``/update_weights_from_disk``: reload every tensor from an HF checkpoint (validated first)."""
        with self._cv:
            self._require_session("update_weights_from_disk", session_id)
        with HFCheckpoint(path) as ckpt:
            validate_checkpoint(self.spec, ckpt)
        return self._run_update(
            "update_weights_from_disk",
            lambda: self.driver.run(Op.UPDATE_FROM_DISK, path=path),
            weight_version,
            "Succeeded to update model weights.",
            session_id,
        )

    def init_group(self, **kwargs: Any) -> dict[str, Any]:
        """``/init_weights_update_group``: every rank joins in the background (the engine generates
        meanwhile) and this call waits at most ``group_timeout_s`` for all of them.

        Raises:
            ValueError: the group exists.
            EngineTimeout: the rendezvous did not complete in time (names the master).
            RuntimeError: a rank failed to join (its message).
        """
        name = kwargs["group_name"]
        where = f"{kwargs['master_address']}:{kwargs['master_port']}"
        with self._cv:
            if name in self._groups or name in self._joining:
                raise ValueError(f"weight update group {name!r} exists; destroy it first")
            self._joining.add(name)
        try:
            self._call(lambda: self.driver.run(Op.INIT_GROUP_START, **kwargs), "init_weights_update_group")
            deadline = time.monotonic() + self.group_timeout_s + 5.0  # the ranks' own deadline comes first
            while True:
                statuses = self._call(lambda: self.driver.run(Op.GROUP_STATUS, group_name=name),
                                      "init_weights_update_group")
                failed = [s for s in statuses if s not in ("ok", "pending")]
                if failed or all(s == "ok" for s in statuses):
                    break
                if time.monotonic() >= deadline:
                    failed = [f"the rendezvous with the master at {where} did not complete within "
                              f"{self.group_timeout_s:.0f} s"]
                    break
                time.sleep(GROUP_POLL_S)
            if failed:
                self._call(lambda: self.driver.run(Op.ABANDON_GROUP, group_name=name), "init_weights_update_group")
                raise GroupError("; ".join(failed))
        finally:
            with self._cv:
                self._joining.discard(name)
        with self._cv:
            self._groups.add(name)
        return {"success": True, "message": "Succeeded to initialize custom process group.", "per_rank": statuses}

    def destroy_group(self, group_name: str) -> dict[str, Any]:
        """``/destroy_weights_update_group``."""
        if group_name not in self._groups:
            raise ValueError("The group to be destroyed does not exist.")
        msgs = self._call(lambda: self.driver.run(Op.DESTROY_GROUP, group_name=group_name),
                          "destroy_weights_update_group")
        self._groups.discard(group_name)
        return {"success": True, "message": "Succeeded to destroy custom process group.", "per_rank": msgs}

    def check_weights(
        self, action: str, seed: int = 0, allow_quant_error: bool = False, skip: tuple[str, ...] = ()
    ) -> list[Any]:
        """``/weights_checker``: per-rank results of ``action`` (``reset_tensors`` makes the weights
        dirty; outside a session it also pauses the engine)."""
        if action == "reset_tensors":
            with self._cv:
                self._refuse_if_generating("reset_tensors")
                self.dirty = True
                if self.session is not None and self.state is State.UPDATING:
                    self.session.wrote = True
                elif self.state is State.SERVING:
                    self.state = State.PAUSED
                if self._dirty_idle():
                    self._fail_queued(Unavailable(self._dirty_message()))
        return self._call(
            lambda: self.driver.run(
                Op.CHECK_WEIGHTS, action=action, seed=seed, allow_quant_error=allow_quant_error, skip=skip
            ),
            f"weights_checker {action}",
        )

    def set_weight_version(self, version: str, abort_all_requests: bool = False,
                           session_id: str | None = None) -> str:
        """``/update_weight_version``: inside a session, the version ``end_weight_update``
        publishes; after an ended session, the publication (dirty cleared); on clean weights, a
        new label. Returns what happened.

        Raises:
            Conflict: dirty weights outside an update (a label cannot clean them).
        """
        with self._cv:  # refused calls abort nothing
            self._check_session(session_id)
            if self.dirty and self.state not in (State.UPDATING, State.ENDED):
                raise Conflict(self._dirty_message())
        if abort_all_requests:
            self._abort_all("Aborted", retract=False)
        with self._cv:
            self._check_session(session_id)
            if self.state is State.UPDATING and self.session is not None:
                self.session.version = version
                return "pending"
            if self.state is State.ENDED and self.session is not None:
                self._publish(version)
                self._cv.notify_all()
                return "published"
            if self.dirty:
                raise Conflict(self._dirty_message())
            self.weight_version = version
            return "labelled"

    def flush_cache(self) -> bool:
        """``/flush_cache``: no KV outlives a batch, so this only reports whether the engine is idle."""
        with self._cv:
            return not self._running

    def prompt_logits(self, prompts: list[list[int]]) -> Any:
        """Full logits of each prompt (debug and tests); waits for the running batch."""
        return self._call(lambda: self.driver.run(Op.PROMPT_LOGITS, prompts=prompts), "prompt_logits")[0]

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {
                "state": self.state.value,
                "weights_dirty": self.dirty,
                "weight_version": self.weight_version,
                "session_id": self.session.id if self.session is not None else None,
                "pending_weight_version": self.session.version if self.session is not None else None,
                "num_queued": len(self._pending),
                "batch_running": self._running,
                "fault": self._fault,
            }


class GroupError(RuntimeError):
    """Joining a weight-update group failed (HTTP 400 with sglang's message)."""
