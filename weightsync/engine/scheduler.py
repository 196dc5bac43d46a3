"""Rank 0's scheduler: one driver thread that batches generation and runs every other job between batches.

Generation requests queue (at most ``max_queued_requests`` waiting or running: 429 beyond,
:class:`QueueFull`) and run in batches of up to ``max_batch_size``; a batch runs to completion
unless it is stopped. Whether a new request is taken, and whether a batch may start, is not the
scheduler's decision but its :class:`Gate`'s -- the engine's weight-update sessions
(:mod:`weightsync.engine.session`, where the engine's states and their table are), which also stop
generation for a pause and hand their work to the driver thread as jobs (:meth:`Scheduler.call`):
a job runs between batches, never inside one.

**Flips.** A pause-free update is published by :meth:`Scheduler.flip`: the session's copy of the
weights becomes the served one on every rank at a step boundary. A running batch flips between
two of its decode steps (rank 0 takes the flip through the batch's ``take_flip`` hook and every
rank applies it before the next forward step), so its requests keep their KV and go on under the
new version; ``recompute`` instead requeues them with their tokens (they re-prefill under the new
version), ``abort`` ends them. With no batch running the flip is a job. Every answer carries its
versions (:attr:`~weightsync.engine.engine.GenResult.version_spans`): the one it started with and
each flip's from the output index it took effect at.

Stopping a batch (:meth:`Scheduler.stop_generation`) ends it at its next step. ``abort`` ends its
requests and answers the queued ones, all with finish reason ``abort`` and the tokens they had;
``retract`` requeues its unfinished requests *with the tokens they generated*: when generation
resumes each re-prefills prompt + generated tokens (no KV is kept across a stop: the weights may
change meanwhile) and goes on until its own ``max_new_tokens``; its one answer holds every token,
the logprobs recorded when each was generated, and ``num_retractions``. ``abort_request`` ends one
request (queued: at once; running: the batch stops and its other requests are requeued as by
``retract``) or all of them.

**Limits and deadlines.** Every job handed to the driver thread is waited for at most
``job_timeout_s``, stopping the running batch at most ``stop_timeout_s``; each timeout raises
:class:`EngineTimeout` naming what and how long. A batch whose step failed on rank 0 ends on every
rank (the requests get the error, the engine goes on); any other failure of a batch, or a job that
never finishes, marks the engine faulted (``/health`` 503).

Every collective runs on the driver thread; HTTP handlers (in their own threads) submit work and
wait for its future.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from weightsync.engine.answers import Pending, aborted, continuation, merged, spans_of
from weightsync.engine.config import IN_FLIGHT_AT_FLIP
from weightsync.engine.control import Driver, Op, RankError
from weightsync.engine.engine import FlipAt, GenRequest
from weightsync.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUED = 1024
DEFAULT_JOB_TIMEOUT_S = 1800.0
DEFAULT_STOP_TIMEOUT_S = 360.0


class Unavailable(Exception):
    """The engine cannot serve the request now (HTTP 503): dirty weights, a fault, shutting down."""

    http_status: ClassVar[int] = 503


class QueueFull(Exception):
    """Too many requests wait or run (HTTP 429)."""

    http_status: ClassVar[int] = 429


class EngineTimeout(TimeoutError):
    """A bounded wait inside the engine expired; the message names what and how long."""

    http_status: ClassVar[int] = 504


HEALTH_CHECK_PREFIX = "HEALTH_CHECK_"
"""rid prefix of ``/health_generate`` probes (sglang's)."""


class Gate(Protocol):
    """What the scheduler asks before it takes a request or starts a batch (the engine's update
    sessions answer; the scheduler's lock is held for every call)."""

    state: str
    """The engine's state, for messages."""
    weight_version: str
    """The version a batch started now generates with (its answers carry it)."""

    def may_generate(self) -> bool:
        """A batch may start now."""
        ...

    def admit(self) -> None:
        """A new request may queue; raises :class:`Unavailable` (the reason) when not."""
        ...


@dataclass(slots=True)
class _Flip:
    """A pending publication (:meth:`Scheduler.flip`)."""

    version: str
    on_flip: Callable[[], None]
    """Called under the lock when the flip is applied (the sessions publish the version)."""
    taken: bool = False
    """A running batch took it (else the flip job applies it)."""
    answer: dict[str, Any] = dataclasses.field(default_factory=dict)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


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

        sched = Scheduler(driver)
        sessions = UpdateSessions(sched, transfer_infos=driver.run(Op.TRANSFER_INFO))  # the gate
        sched.start()
        result, version = sched.submit([req])[0].result()
        sched.stop()
    """

    def __init__(
        self,
        driver: Driver,
        *,
        max_batch_size: int = 32,
        max_queued_requests: int = DEFAULT_MAX_QUEUED,
        job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
    ) -> None:
        """Args:
        driver: rank 0's driver of the engine's ranks.
        max_batch_size: requests per batch.
        max_queued_requests: requests waiting or running at once (more: :class:`QueueFull`).
        job_timeout_s: how long a caller waits for a job on the driver thread.
        stop_timeout_s: how long stopping the running batch (pause, abort, stop) may take.
        """
        self.driver = driver
        self.spec = driver.engine.spec
        self.max_batch_size = max_batch_size
        self.max_queued_requests = max_queued_requests
        self.job_timeout_s = job_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.gate: Gate | None = None
        """Set once, by the engine's update sessions (:meth:`attach`), before :meth:`start`."""
        self.lock = threading.Condition()
        """Guards the queue and the gate's state; notified whenever either changes."""
        self._pending: deque[Pending] = deque()
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()
        self.running = False
        """A batch is running (read under :attr:`lock`)."""
        self._batches = 0
        """Batches started so far (the running one's number, while one runs)."""
        self._stop_at: int | None = None
        """The batch being stopped (a stop never reaches the batches after it)."""
        self._retract = False
        self._cancel: set[str] = set()
        """rids that ``abort_request`` ends while their batch runs (the others are requeued)."""
        self._rids: set[str] = set()
        """rids of every request not answered yet (sglang refuses a duplicate)."""
        self._flip: _Flip | None = None
        """The publication a running batch applies at its next step boundary (None: none pending)."""
        self.fault: str | None = None
        """Why the engine is unhealthy (a batch failed on some rank, the driver is stuck), or None."""
        self.stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-driver", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def attach(self, gate: Gate) -> None:
        """Make ``gate`` the one that decides what may generate (once, before :meth:`start`)."""
        if self.gate is not None:
            raise ValueError("this scheduler already has its gate")
        self.gate = gate

    def start(self) -> None:
        self._gate()
        self._thread.start()

    def _gate(self) -> Gate:
        if self.gate is None:
            raise ValueError("the scheduler has no gate: build the engine's UpdateSessions on it first")
        return self.gate

    def _may_generate(self) -> bool:
        return self.fault is None and self._gate().may_generate()

    def _version(self) -> str:
        return self._gate().weight_version

    def stop(self) -> bool:
        """Finish the running work (at most ``stop_timeout_s``), fail queued requests, release the
        worker ranks. Returns False when the driver thread did not stop in time (the ranks are
        then left to die with this process)."""
        self.begin_stop()
        self._thread.join(timeout=self.stop_timeout_s)
        if self._thread.is_alive():
            logger.error("the engine's driver did not stop within %.0f s (stuck in a collective?); "
                         "leaving the ranks to exit with this process", self.stop_timeout_s)
            return False
        self.driver.shutdown()
        return True

    def begin_stop(self) -> None:
        """Refuse new work from now on (``Unavailable``), stop the running batch, let queued jobs
        finish; :meth:`stop` then waits for the driver. Callers waiting in a loop of jobs (a group
        join polling its ranks) get ``Unavailable`` at their next call."""
        with self.lock:
            self.stopped = True
            self.lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not (self.stopped or self._jobs or (self._may_generate() and self._pending)):
                    self.lock.wait()
                if self._jobs:
                    job, fut = self._jobs.popleft()
                    batch = None
                elif self.stopped:
                    break
                else:
                    batch = [self._pending.popleft() for _ in range(min(self.max_batch_size, len(self._pending)))]
                    for p in batch:
                        if p.future.cancelled():  # its client went away
                            self._rids.discard(p.req.rid)
                    batch = [p for p in batch if not p.future.cancelled()]
                    if not batch:
                        continue
                    self.running = True
                    self._batches += 1
                    version, number = self._version(), self._batches
            if batch is None:
                self._run_job(job, fut)
            else:
                self._run_batch(batch, version, number)
        with self.lock:
            for p in self._pending:
                self._answer(p, exc=Unavailable("the engine is shutting down"))
            self._pending.clear()

    @staticmethod
    def _run_job(job: Callable[[], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(job())
        except BaseException as exc:  # handed to the waiting caller, which re-raises it
            fut.set_exception(exc)

    def _run_batch(self, batch: list[Pending], version: str, number: int) -> None:
        try:
            results = self.driver.run(Op.GENERATE, should_abort=lambda: self.stopped or self._stop_at == number,
                                      take_flip=self._take_flip, reqs=[p.req for p in batch])[0]
        except BaseException as exc:
            step_failed = isinstance(exc, RankError) and exc.step_error
            with self.lock:
                if not step_failed:  # the ranks may be out of step: stop serving
                    self.fault = f"a generation batch failed: {exc}"
                    logger.error("engine fault: %s", self.fault)
                for p in batch:
                    self._answer(p, exc=exc)
                self.running = False
                self.lock.notify_all()
            return
        with self.lock:
            requeue = []
            try:
                for p, r in zip(batch, results, strict=True):
                    spans = spans_of(p, r, version)
                    answer = merged(p.partial, r)
                    answer.version_spans = spans
                    ended = bool(r.finish_reason) and r.finish_reason.get("type") == "abort"
                    if (ended and self._retract and p.req.rid not in self._cancel
                            and "status_code" not in r.finish_reason):
                        answer.num_retractions += 1
                        requeue.append(Pending(continuation(p.req, answer), p.future, answer))
                    else:
                        self._answer(p, (answer, spans[-1][1]))
            except Exception as exc:  # a bug in turning results into answers: fail this batch, keep serving
                logger.exception("batch %d: its results could not be turned into answers", number)
                requeue = []
                for p in batch:
                    if not p.future.done():
                        self._answer(p, exc=exc)
            self._pending.extendleft(reversed(requeue))
            self.running = False
            self.lock.notify_all()

    def _answer(self, p: Pending, value: Any = None, exc: BaseException | None = None) -> None:
        """Resolve ``p`` and forget its rid (caller holds the lock)."""
        self._rids.discard(p.req.rid)
        _resolve(p.future, value, exc)

    def call(self, job: Callable[[], Any], what: str = "", timeout_s: float | None = None) -> Any:
        """Run ``job`` on the driver thread (after the running batch) and wait for its result, at
        most ``timeout_s`` (default ``job_timeout_s``).

        Raises:
            Unavailable: shutting down, or the engine is faulted.
            EngineTimeout: no result in time (the engine is marked faulted: its driver is stuck).
        """
        with self.lock:
            fut = self._queue_job(job)
        return self._wait_job(fut, what, timeout_s)

    def _queue_job(self, job: Callable[[], Any]) -> Future:
        """Queue ``job`` for the driver thread (caller holds the lock)."""
        if self.stopped:
            raise Unavailable("the engine is shutting down")
        if self.fault is not None:
            raise Unavailable(f"the engine is faulted ({self.fault}); restart it")
        fut: Future = Future()
        self._jobs.append((job, fut))
        self.lock.notify_all()
        return fut

    def _wait_job(self, fut: Future, what: str, timeout_s: float | None) -> Any:
        limit = self.job_timeout_s if timeout_s is None else timeout_s
        try:
            return fut.result(timeout=limit)
        except TimeoutError:
            if fut.cancel():  # never started: the driver is busy, not stuck
                raise EngineTimeout(f"{what or 'engine job'} did not start within {limit:.0f} s "
                                    f"(the engine is busy)") from None
            with self.lock:
                self.fault = f"{what or 'an engine job'} did not finish within {limit:.0f} s"
            raise EngineTimeout(f"{self.fault}; the engine is marked faulted (restart it)") from None

    # ------------------------------------------------------------------ flips

    def flip(self, version: str, *, on_flip: Callable[[], None], in_flight: str = "keep") -> dict[str, Any]:
        """Publish the open update session's copy on every rank (module docstring, "Flips") and
        wait until rank 0 serves it.

        Args:
            version: the version it publishes (the running requests' spans record it).
            on_flip: called under the lock as the flip is applied (the sessions' publication).
            in_flight: ``keep``, ``recompute`` or ``abort``: what becomes of a running batch.

        Returns:
            Rank 0's :meth:`~weightsync.engine.engine.Engine.publish` answer (``flip``,
            ``seconds``), ``at`` (``step`` or ``between batches``) and ``idle_s``: how long
            generation stood still for it (the flip's own seconds at a step, the job's otherwise).

        Raises:
            ValueError: an unknown ``in_flight``.
            EngineTimeout, Unavailable: as :meth:`call`.
        """
        if in_flight not in IN_FLIGHT_AT_FLIP:
            raise ValueError(f"in_flight must be one of {', '.join(IN_FLIGHT_AT_FLIP)}, got {in_flight!r}")
        req = _Flip(version, on_flip)
        with self.lock:
            # queued before a batch is stopped: the flip runs before the requeued requests do
            fut = self._queue_job(lambda: self._flip_job(req))
            if self.running and in_flight == "keep":
                self._flip = req
            elif self.running:
                self._stop_batch(requeue=in_flight == "recompute")
        self._wait_job(fut, "the flip", None)
        return req.answer

    def _take_flip(self) -> FlipAt | None:
        """Rank 0, at a step boundary of the running batch: the pending flip, if any."""
        with self.lock:
            req, self._flip = self._flip, None
            if req is None:
                return None
            req.taken = True
            req.on_flip()

        def done(out: dict[str, Any]) -> None:
            req.answer = {**out, "at": "step", "idle_s": out["seconds"]}
            req.done.set()

        return FlipAt(version=req.version, done=done)

    def _flip_job(self, req: _Flip) -> None:
        """The flip as a job: nothing when the batch before it took it; else on every rank now."""
        with self.lock:
            if self._flip is req:
                self._flip = None
        if req.taken:  # by the batch before this job: it flipped, or it failed before it could
            if not req.done.is_set():
                raise RuntimeError("the flip was taken by a generation batch that failed before applying it")
            return
        t0 = time.perf_counter()
        out = self.driver.run(Op.PUBLISH)[0]
        with self.lock:
            req.on_flip()
        req.answer = {**out, "at": "between batches", "idle_s": time.perf_counter() - t0}
        req.done.set()

    # ------------------------------------------------------------------ generation

    def submit(self, reqs: list[GenRequest]) -> list[Future]:
        """Queue requests; each future resolves to ``(GenResult, weight_version)``.

        Raises:
            ValueError: a rid is already in flight (sglang refuses duplicates too).
            Unavailable: the weights are dirty outside an update, the engine is faulted or stopping.
            QueueFull: more than ``max_queued_requests`` would wait or run.
        """
        futures = []
        with self.lock:
            if self.stopped:
                raise Unavailable("the engine is shutting down")
            if self.fault is not None:
                raise Unavailable(f"the engine is faulted ({self.fault}); restart it")
            self._gate().admit()
            if len(self._rids) + len(reqs) > self.max_queued_requests:
                raise QueueFull(f"{len(self._rids)} requests are waiting or running; this engine takes at most "
                                f"{self.max_queued_requests} (retry later)")
            dup = sorted({r.rid for r in reqs} & self._rids)
            if dup:
                raise ValueError(f"duplicate request id(s) {dup[:5]}: a request with this rid is still in flight")
            for r in reqs:
                fut: Future = Future()
                self._pending.append(Pending(r, fut))
                self._rids.add(r.rid)
                futures.append(fut)
            self.lock.notify_all()
        return futures

    def fail_queued(self, exc: BaseException) -> None:
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
        if not self.running:
            return
        number = self._batches  # the requests it requeues may start the next batch before this wakes
        self._stop_at, self._retract, self._cancel = number, requeue, set(cancel)
        end = time.monotonic() + self.stop_timeout_s
        try:
            while self.running and self._batches == number:
                if not self.lock.wait(timeout=max(end - time.monotonic(), 0.0)) and time.monotonic() >= end:
                    self.fault = f"the running batch did not stop within {self.stop_timeout_s:.0f} s"
                    raise EngineTimeout(f"{self.fault}; the engine is marked faulted (restart it)")
        finally:
            if self._stop_at == number:
                self._stop_at, self._retract, self._cancel = None, False, set()

    def stop_generation(self, why: str, *, retract: bool) -> int:
        """Stop the running batch (waits) and, unless retracting, answer queued requests as aborted."""
        with self.lock:
            dropped = 0
            if not retract:
                dropped = len(self._pending)
                for p in self._pending:
                    self._answer(p, (aborted(p.req, why, p.partial), self._version()))
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
            with self.lock:
                n = len(self._rids)
            self.stop_generation(why, retract=False)
            return n
        with self.lock:
            for p in list(self._pending):
                if p.req.rid == rid:
                    self._pending.remove(p)
                    self._answer(p, (aborted(p.req, why, p.partial), self._version()))
                    return 1
            if rid in self._rids and self.running:
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
            with self.lock:
                self._pending = deque(p for p in self._pending if p.future is not fut)
                self._rids.discard(probe.rid)
            fut.cancel()
            return False, f"no token generated within {timeout_s:.0f} s (state {self._gate().state})"
        except Exception as exc:  # the probe's own failure is the answer
            return False, f"the probe failed: {exc}"
        return True, ""

    def flush_cache(self) -> bool:
        """``/flush_cache``: no KV outlives a batch, so this only reports whether the engine is idle."""
        with self.lock:
            return not self.running

    def prompt_logits(self, prompts: list[list[int]]) -> Any:
        """Full logits of each prompt (debug and tests); waits for the running batch."""
        return self.call(lambda: self.driver.run(Op.PROMPT_LOGITS, prompts=prompts), "prompt_logits")[0]

    def status(self) -> dict[str, Any]:
        """The queue and the driver: ``num_queued``, ``batch_running``, ``fault``."""
        with self.lock:
            return {"num_queued": len(self._pending), "batch_running": self.running, "fault": self.fault}

    def generating(self) -> bool:
        """A batch runs, or queued requests are about to run (caller holds :attr:`lock`)."""
        return self.running or (self._may_generate() and bool(self._pending))
